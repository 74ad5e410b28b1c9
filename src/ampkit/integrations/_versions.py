"""The framework versions the integrations were tested with, and the check that the
few non-public hooks they override are still there.

The extras allow each framework up to its next major release (``pyproject.toml``). Most
of what an integration uses is the framework's public API; where it overrides a
non-public method (Lightning's ``Precision._after_closure``, the HF ``Trainer``'s
``_save`` and ``create_accelerator_and_postprocess``), a release may rename it. So the
integration checks, when it is imported, that those methods exist, and otherwise
refuses with an ``ImportError`` that names the release it was tested with, instead of
training with a hook that is never called.
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["TESTED", "require_hooks"]

#: framework (distribution name) -> the release the integration tests pass with
TESTED: dict[str, str] = {"lightning": "2.6.6", "transformers": "5.23.0",
                          "accelerate": "1.15.0"}


def require_hooks(integration: str, framework: str, owner: type,
                  names: tuple[str, ...]) -> None:
    """Refuse to import ``ampkit.integrations.<integration>`` when ``owner`` lacks one
    of the non-public methods ``names`` that it overrides or calls.

    Raises:
        ImportError: naming the missing methods, the installed release and the tested
            one, with the pip command that installs it.

    Example:
        >>> from ampkit.integrations._versions import require_hooks
        >>> class Trainer:
        ...     def _save(self): ...
        >>> require_hooks("transformers", "transformers", Trainer, ("_save",))
        >>> require_hooks("transformers", "transformers", Trainer, ("_save", "_gone"))
        Traceback (most recent call last):
        ...
        ImportError: ampkit.integrations.transformers overrides Trainer._gone, which ...
    """
    missing = [name for name in names if not callable(getattr(owner, name, None))]
    if not missing:
        return
    try:
        installed = importlib.metadata.version(framework)
    except importlib.metadata.PackageNotFoundError:
        installed = "(version unknown)"
    tested = TESTED[framework]
    methods = ", ".join(f"{owner.__qualname__}.{name}" for name in missing)
    raise ImportError(
        f"ampkit.integrations.{integration} overrides {methods}, which {framework} "
        f"{installed} does not have (it is not the framework's public API); it was tested "
        f"with {framework} {tested}: pip install '{framework}=={tested}'")
