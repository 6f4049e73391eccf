"""The `minivllm` command line: one module per sub-command.

How the package works (the design notes that ARCHITECTURE.md used to carry):

`minivllm models / generate / bench / diverge / serve / smoke`. A `MinivllmError`
becomes one `error:` line and exit code 2
"""
