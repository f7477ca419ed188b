"""Oracle tests: the engines' own released code, run on the same adapters as lorafast.compat."""
