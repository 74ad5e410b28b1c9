"""The conformance matrix's folder: its command-line entry is not a test module."""

collect_ignore = ["__main__.py"]
