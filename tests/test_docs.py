"""The documentation is complete and its code runs.

- Every public name (``functopt.__all__``, and the ``__all__`` of every subpackage the
  reference documents) appears in the rendered API reference: the site is built with mkdocs
  into a temporary folder and the anchors of its API pages are resolved back to objects.
- Every module of ``functopt/transforms/`` and every documented subpackage has a ``:::``
  directive, and every page is in the nav.
- Every ```` ```python ```` block of the guides and the README runs (each block on its own) without error;
  the blocks end in ``assert`` statements, so they check what the prose claims. Blocks inside
  content tabs (indented fences) run too. Code of other systems that cannot run here
  (Megatron-LM, LightRFT) is fenced as ```` ```text ```` and says so in the prose.

- Every public function and class of those namespaces has an ``Examples:`` section with a
  ``>>>`` line in its docstring (the doctests run them), except the kinds listed in
  ``exempt_from_examples``.

The site is built ``--strict`` (a warning is an error), as ``make docs`` builds it: this
test is the strict docs build of ``make test``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import functopt

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API = DOCS / "api"
DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)
# A fence may be indented (inside a content tab or an admonition): the block is dedented.
PYTHON_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```\s*$", re.MULTILINE | re.DOTALL)
ANCHOR = re.compile(r'id="(functopt(?:\.\w+)+)"')


def directives() -> dict[str, Path]:
    """``{module path: page}`` for every ``::: module`` line of the API pages."""
    found: dict[str, Path] = {}
    for page in sorted(API.rglob("*.md")):
        for target in DIRECTIVE.findall(page.read_text()):
            assert target not in found, f"{target} is documented twice: {found[target]}, {page}"
            found[target] = page
    return found


def resolve(dotted: str) -> Any:
    """The object named by a dotted path such as ``functopt.transforms.moments.ScaleByAdamState.mu``."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> set[int]:
    """``id()`` of every object with an anchor in the built API pages."""
    pytest.importorskip("mkdocs")
    site = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
         str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    objects: set[int] = set()
    for html in (site / "api").rglob("*.html"):
        for anchor in set(ANCHOR.findall(html.read_text())):
            try:
                objects.add(id(resolve(anchor)))
            except (ImportError, AttributeError):
                continue  # an anchor that is not an object (a heading in the page)
    for target in directives():
        objects.add(id(resolve(target)))  # a documented module counts as rendered itself
    assert len(objects) > 20, "the API pages rendered almost nothing: is mkdocstrings set up?"
    return objects


def documented_namespaces() -> list[ModuleType]:
    """``functopt`` and the public subpackages whose own ``__all__`` the reference documents."""
    spaces = [functopt]
    for target in directives():
        module = resolve(target)
        if isinstance(module, ModuleType) and not any(p.startswith("_") for p in target.split(".")):
            if not target.startswith("functopt.transforms.") and target != "functopt.optimizers":
                spaces.append(module)
    return spaces


def test_every_public_name_is_rendered(rendered: set[int]) -> None:
    missing = []
    for namespace in documented_namespaces():
        for name in namespace.__all__:
            if id(getattr(namespace, name)) not in rendered:
                missing.append(f"{namespace.__name__}.{name}")
    assert not missing, (
        f"public names missing from the rendered API reference: {missing}. Fix: add a "
        f"`::: module` directive for the module that defines them to a page under docs/api/ "
        f"(and that page to the nav in mkdocs.yml)."
    )


def test_every_module_has_a_directive() -> None:
    documented = set(directives())
    expected = {
        f"functopt.transforms.{path.stem}"
        for path in (ROOT / "functopt" / "transforms").glob("*.py")
        if not path.stem.startswith("_")
    }
    expected |= {"functopt._base", "functopt._apply", "functopt.tree", "functopt.schedules"}
    expected |= {
        f"functopt.testing.{path.stem}"
        for path in (ROOT / "functopt" / "testing").glob("*.py")
        if not path.stem.startswith("_")
    }
    for optional in ("functopt.optimizers", "functopt.precision", "functopt.adapters"):
        if (ROOT / optional.replace(".", "/")).with_suffix(".py").exists() or (
            ROOT / optional.replace(".", "/")
        ).is_dir():
            expected.add(optional)
    assert expected <= documented, f"modules without an API page: {sorted(expected - documented)}"
    for target in documented:
        resolve(target)  # every directive names an importable module


def test_every_page_is_in_the_nav() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(node: Any) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, dict):
            return [p for value in node.values() for p in pages(value)]
        return [p for item in node for p in pages(item)]

    in_nav = pages(config["nav"])
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(in_nav) == on_disk, (
        f"not in the nav: {sorted(set(on_disk) - set(in_nav))}; "
        f"in the nav but missing: {sorted(set(in_nav) - set(on_disk))}"
    )
    assert config["plugins"][-1]["mkdocstrings"]["handlers"]["python"]["options"][
        "docstring_style"
    ] == "google"


def python_blocks() -> list[Any]:
    blocks = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for i, (_, code) in enumerate(PYTHON_BLOCK.findall(page.read_text())):
            blocks.append(pytest.param(page, textwrap.dedent(code),
                                       id=f"{page.relative_to(ROOT)}-{i}"))
    return blocks


BLOCKS = python_blocks()


def test_guides_have_code() -> None:
    pages = {block.values[0].name for block in BLOCKS}
    for page in ("README.md", "index.md", "getting-started.md", "concepts.md", "coming-from-optax.md",
                 "coming-from-torch-optim.md", "testing.md", "mixed-precision.md",
                 "sharded-state.md"):
        assert page in pages, f"docs/{page} has no ```python block"


def test_every_python_fence_is_collected() -> None:
    """No ```python fence escapes the runner (an unterminated or oddly indented one would)."""
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = page.read_text()
        fences = len(re.findall(r"^ *```python *$", text, re.MULTILINE))
        assert len(PYTHON_BLOCK.findall(text)) == fences, f"{page}: a ```python block is not run"


@pytest.mark.parametrize(("page", "code"), BLOCKS)
def test_python_block_runs(page: Path, code: str) -> None:
    namespace: dict[str, Any] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    exec(compile(code, str(page), "exec"), namespace)


# ------------------------------------------------------------ an example for every public name

EXAMPLES = re.compile(r"^Examples?:[ \t]*\n(?:[ \t]*\n)*[ \t]+>>> ", re.MULTILINE)


def exempt_from_examples(obj: Any) -> str | None:
    """Why ``obj`` needs no example of its own, or ``None`` if it needs one.

    The rule, in full:

    1. Not a function or a class (a submodule, a constant, a type alias such as
       ``ScalarOrSchedule``): there is nothing to call.
    2. An alias of a ``typing`` object (``Params = State = Updates = Any``).
    3. A NamedTuple (a transform's ``<Name>State``, ``GradStats``, ``StepMetrics``,
       ``LossScale``, ``MixedPrecisionTransformation``, ...): a record of fields, built and
       shown by the Example of the function that returns it.
    4. A ``typing.Protocol`` (``TransformInitFn``, ``ShouldSkipUpdateFunction``): a call
       signature, not something to call.
    """
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return "not a function or class"
    if getattr(obj, "__module__", None) == "typing":
        return "a typing alias"
    if inspect.isclass(obj) and issubclass(obj, tuple) and hasattr(obj, "_fields"):
        return "a NamedTuple, shown by the function that returns it"
    if inspect.isclass(obj) and getattr(obj, "_is_protocol", False):
        return "a Protocol (a call signature)"
    return None


def public_objects() -> dict[str, Any]:
    """``{qualified public name: object}`` over ``functopt`` and the documented subpackages."""
    found: dict[str, Any] = {}
    for namespace in documented_namespaces():
        for name in namespace.__all__:
            found[f"{namespace.__name__}.{name}"] = getattr(namespace, name)
    return found


def test_every_public_name_has_an_example() -> None:
    missing = sorted(
        name for name, obj in public_objects().items()
        if exempt_from_examples(obj) is None
        and not EXAMPLES.search(inspect.cleandoc(obj.__doc__ or ""))
    )
    assert not missing, (
        f"public functions and classes whose docstring has no `Examples:` section with a "
        f"`>>>` line: {missing}. Fix: add a short doctested example (the doctests run it)."
    )


def test_the_example_exemptions_stay_small() -> None:
    """The exemptions are the kinds that ``exempt_from_examples`` names, and few callables."""
    objects = public_objects()
    assert len(objects) > 100, "documented_namespaces() found too few names"
    exempt = {name: why for name, obj in objects.items() if (why := exempt_from_examples(obj))}
    callables_exempt = [name for name, why in exempt.items() if why != "not a function or class"]
    # NamedTuples (states and records), three typing aliases, a few protocols: not more
    # than a third of the public names; a growing share means examples are being skipped.
    assert len(callables_exempt) < len(objects) / 3, sorted(callables_exempt)
    assert exempt_from_examples(functopt.adam) is None
    assert exempt_from_examples(functopt.ScaleByAdamState) is not None
