"""The leaf helpers every layer shares; they import nothing of ampkit but
``ampkit.torch_internals``.

- ``arguments``: the one parser of dtypes, devices, counts and loss scales, with one
  error wording;
- ``containers``: the one walk of lists, tuples, namedtuples, dicts and dataclasses;
- ``module_selection``: modules chosen by type, name or instance;
- ``device_support``: whether this machine's device computes in float16/bfloat16;
- ``compile_frames``: keeping ampkit's bookkeeping out of ``torch.compile``'s traces;
- ``step_hooks``: ampkit's one global optimizer step hook;
- ``text``: the plain-text tables the tools and ``fp8`` print;
- ``lazy``: names of a package imported on first use;
- ``unpickling``: loading pickles that name a module path ampkit no longer has.

Example:
    >>> from ampkit.common.arguments import parse_dtype
    >>> parse_dtype("bf16", "dtype")
    torch.bfloat16
"""
