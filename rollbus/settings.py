"""One typed settings class per service: the only declaration of each option.

A field of a :class:`Settings` subclass is at once the option's type, default, validation, help text, flag
(``--grade-timeout``) and environment variable (``ROLLBUS_GRADER_GRADE_TIMEOUT``, scoped by the service so one
environment can configure every service). Options every component shares (``--bootstrap-servers``,
``--state-dir``, ``--namespace``) read unscoped variables (``ROLLBUS_BOOTSTRAP_SERVERS``).

Precedence: flag, then variable, then default. A bad value from any source fails before anything starts, with
one line naming where it came from, the value and what was expected (:class:`SettingsError`; ``rollbus.cli``
turns it into exit status 2).

    class GraderSettings(BusSettings):
        model_config = BusSettings.scoped("grader")
        grade_timeout: float = Field(600.0, gt=0, description="seconds one grade may take")

    add_arguments = GraderSettings.add_arguments
    def run(args): settings = GraderSettings.from_args(args)
"""

from __future__ import annotations

import argparse
import enum
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import AliasChoices, Field, SecretStr, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from rollbus.config import recorded_bootstrap

__all__ = ["ADAPTER_URL", "ENGINE_URL", "BusSettings", "Field", "Settings", "SettingsError", "shared"]

DEFAULT_STATE_DIR = Path(".rollbus")
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
# Where each HTTP service listens by default, declared once for it and for the services that call it.
ENGINE_PORT = 30000  # SGLang's default
ENGINE_URL = f"http://127.0.0.1:{ENGINE_PORT}"
ADAPTER_PORT = 8082
ADAPTER_URL = f"http://127.0.0.1:{ADAPTER_PORT}"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


class SettingsError(ValueError):
    """A value from a flag or a variable that does not fit its option; the message is one line."""


def shared(name: str) -> AliasChoices:
    """The alias of a shared option: read from the unscoped ``ROLLBUS_<NAME>`` whatever the service."""
    return AliasChoices(name, f"ROLLBUS_{name.upper()}")


class Settings(BaseSettings):
    """Base of every service's settings; subclasses set ``model_config = Settings.scoped("<service>")``."""

    model_config = SettingsConfigDict(
        env_prefix="ROLLBUS_", frozen=True, extra="ignore", populate_by_name=True, validate_default=True
    )

    @staticmethod
    def scoped(service: str) -> SettingsConfigDict:
        prefix = "ROLLBUS_" + service.replace("-", "_").upper() + "_"
        return SettingsConfigDict(
            env_prefix=prefix, frozen=True, extra="ignore", populate_by_name=True, validate_default=True
        )

    # -- the command line, built from the fields ----------------------------------------------------------

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field; values stay raw strings here and are validated once, in :meth:`from_args`."""
        for name, info in cls.model_fields.items():
            flag = cls.flag(name)
            kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
            if _is_bool(info.annotation):
                kwargs.update(nargs="?", const="true", metavar="BOOL")
            else:
                kwargs["metavar"] = _metavar(name, info)
            parser.add_argument(flag, help=cls._help(name, info), **kwargs)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Self:
        """Flags given on the command line, then variables, then defaults; SettingsError names the culprit."""
        given = {name: getattr(args, name) for name in cls.model_fields if hasattr(args, name)}
        return cls.load(given)

    @classmethod
    def load(cls, given: dict[str, Any] | None = None) -> Self:
        given = dict(given or {})
        for name, raw in list(given.items()):
            if isinstance(raw, str) and _is_bool(cls.model_fields[name].annotation):
                given[name] = _parse_bool_word(raw, cls.flag(name))
        try:
            return cls(**given)
        except ValidationError as exc:
            raise SettingsError(cls._explain(exc, given)) from None

    @classmethod
    def flag(cls, name: str) -> str:
        return "--" + name.replace("_", "-")

    @classmethod
    def env_var(cls, name: str) -> str:
        alias = cls.model_fields[name].validation_alias
        if isinstance(alias, AliasChoices):
            return str(alias.choices[-1])
        return str(cls.model_config.get("env_prefix", "")) + name.upper()

    @classmethod
    def _help(cls, name: str, info: FieldInfo) -> str:
        text = (info.description or "").replace("%", "%%")
        choices = _choices(info.annotation)
        if choices:
            text += f" (one of: {', '.join(choices)})"
        return f"{text} [env {cls.env_var(name)}; default {_show_default(info)}]"

    @classmethod
    def _variable_set(cls, name: str) -> str:
        """The variable a value of ``name`` came from: of several aliases, the first one set."""
        alias = cls.model_fields[name].validation_alias
        if isinstance(alias, AliasChoices):
            present = {key.upper() for key in os.environ}
            for choice in alias.choices:
                if isinstance(choice, str) and choice.upper() != name.upper() and choice.upper() in present:
                    return choice
        return cls.env_var(name)

    @classmethod
    def _secret(cls, name: str) -> bool:
        """A SecretStr, or a field declared with ``repr=False`` (a key kept as bytes or str for its users)."""
        info = cls.model_fields[name]
        return _is_secret(info.annotation) or not info.repr

    @classmethod
    def _explain(cls, exc: ValidationError, given: dict[str, Any]) -> str:
        error = exc.errors()[0]
        if not error["loc"]:  # a rule across options (a model validator): its own words are the line
            return str(error.get("ctx", {}).get("error", error["msg"]))
        name = str(error["loc"][0])
        if name not in cls.model_fields:  # the alias form of a shared option
            name = next((n for n in cls.model_fields if n.upper() in name.upper()), name)
        if name in given:
            where = cls.flag(name)
        elif name in cls.model_fields:
            where = cls._variable_set(name)
        else:
            where = name or "settings"
        value = error.get("input")
        shown = "***" if name in cls.model_fields and cls._secret(name) else value
        message = error["msg"]
        return f"{where}={shown!r}: {message[:1].lower()}{message[1:]}"


class BusSettings(Settings):
    """Settings of everything that talks to the bus: where it is, where local state lives, which topics."""

    bootstrap_servers: str = Field(
        DEFAULT_BOOTSTRAP,
        validation_alias=shared("bootstrap_servers"),
        description="Kafka bootstrap servers (any Kafka-compatible cluster); unset: the embedded broker of "
        "--state-dir wherever `rollbus broker start` put it, else the default",
        min_length=1,
    )
    state_dir: Path = Field(
        DEFAULT_STATE_DIR, validation_alias=shared("state_dir"), description="local state directory"
    )
    namespace: str = Field(
        "",
        validation_alias=shared("namespace"),
        description="prefix of the topics used (tests, parallel demos); empty: the real topics",
        pattern=r"^[A-Za-z0-9._-]*$",
    )

    @model_validator(mode="after")
    def _find_embedded_broker(self) -> Self:
        """Unset by flag and variable, the bus is the embedded broker ``rollbus broker start`` recorded in
        the state dir, on whatever port it found free (``127.0.0.1:9092`` if none was recorded)."""
        if "bootstrap_servers" not in self.model_fields_set:
            found = recorded_bootstrap(self.state_dir)
            if found is not None:
                object.__setattr__(self, "bootstrap_servers", found)  # frozen: set once, while validating
        return self


# -- helpers over annotations ------------------------------------------------------------------------------


def _parse_bool_word(raw: str, where: str) -> bool:
    if raw.lower() in TRUE_WORDS:
        return True
    if raw.lower() in FALSE_WORDS:
        return False
    raise SettingsError(f"{where}={raw!r}: expected a boolean (1/true/yes/on or 0/false/no/off)")


def _args_of(annotation: Any) -> tuple[Any, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def _is_bool(annotation: Any) -> bool:
    return _args_of(annotation) == (bool,)


def _is_secret(annotation: Any) -> bool:
    return SecretStr in _args_of(annotation)


def _choices(annotation: Any) -> list[str]:
    for arg in _args_of(annotation):
        if typing.get_origin(arg) is Literal:
            return [str(c) for c in typing.get_args(arg)]
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            return [str(m.value) for m in arg]
    return []


def _metavar(name: str, info: FieldInfo) -> str:
    kinds = {int: "N", float: "SECONDS" if "timeout" in name or name.endswith("_s") else "X", Path: "PATH"}
    return kinds.get(_args_of(info.annotation)[0], name.upper().rsplit("_", 1)[-1])


def _show_default(info: FieldInfo) -> str:
    """The default as a user would type it: a path, not PosixPath('...'); secrets never shown."""
    if info.default_factory is not None:
        return "generated" if not _is_secret(info.annotation) else "unset"
    if info.is_required():
        return "none, required"
    value = info.default
    if value is None:
        return "unset"
    if _is_secret(info.annotation):
        return "set"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, Path | str):
        return str(value) if str(value) else "''"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) or "''"
    return str(value)


def env_snapshot(prefix: str = "ROLLBUS_") -> dict[str, str]:
    """The ``ROLLBUS_*`` variables in force (for tests and start-up logs)."""
    return {k: v for k, v in os.environ.items() if k.startswith(prefix)}


class ServiceConsumerSettings(BusSettings):
    """A service that consumes the bus for good, idle for long stretches (the grader, the sandbox runner):
    its empty fetches wait longer on the broker than aiokafka's default."""

    fetch_wait_ms: int = Field(
        2000, ge=0, le=30_000,
        description="how long the broker holds an empty fetch, milliseconds (aiokafka's default: 500): "
        "data that arrives ends the wait at once, so an idle consumer's fetches (~0.5 CPU-ms each) fall "
        "with it at no latency to new work; a seek or resume waits for the fetch in flight, up to this long",
    )  # fmt: skip
