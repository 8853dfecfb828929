"""Counters: the numbers a component keeps about its own work, printed in its repr.

A subclass declares each counter with its type and starting value (``bytes_read: int = 0``);
the value lives on the class until the first update, which gives the instance its own. Plain
classes, not dataclasses: a dataclass compiles its methods from source when its module is
imported, and these modules are imported by a fresh process on its way to its first load.
"""

from __future__ import annotations

from typing import Any, ClassVar


class Counters:
    """Counters declared as annotated class attributes with their starting values (a subclass's
    after its base's); ``repr`` lists them all."""

    _names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._names = cls._names + tuple(cls.__annotations__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{name}={getattr(self, name)!r}' for name in self._names)})"
