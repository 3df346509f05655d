"""The built-in transforms, one module per family (all re-exported from ``functopt``)."""
