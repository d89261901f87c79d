"""The one exception type of :mod:`envs`."""

from __future__ import annotations

__all__ = ["EnvError"]


class EnvError(ValueError):
    """A bad env id, option or set-up, described in one sentence a user can act on.

    Subclasses ``ValueError`` so that callers validating user input can catch either. When
    the problem was raised by other code (a user factory, dm_control, the OpenGL loader)
    the original exception is chained as ``__cause__``.
    """
