"""Every ``kvray`` flag that sets an engine setting, made from ``EngineConfig``'s fields: the
flag's name, type, choices, help and default come from the field and the ``setting`` beside it
(``workers.options``), so a default or a help text is written once. A flag left out leaves the
field's default; a ``KVRAY_*`` variable (``cluster.env``) supplies it first."""

from __future__ import annotations

import argparse
import contextlib
import io
import types
import typing
from dataclasses import dataclass

import msgspec

from cluster.config import EngineConfig
from cluster.env import env_default, parse_bytes

ENGINE, SERVER = "engine", "server"


@dataclass(frozen=True)
class SettingFlag:
    field: str
    kind: type  # int, float, str or bool
    default: object  # the field's
    description: str
    cli: dict  # the setting's command-line spelling (see workers.options.setting)

    @property
    def flag(self) -> str:
        return self.cli.get("flag") or "--" + self.field.replace("_", "-")

    @property
    def dest(self) -> str:
        """The flag's attribute on the parsed arguments, named after the flag."""
        return self.flag[2:].replace("-", "_")

    @property
    def group(self) -> str:
        return self.cli.get("group", ENGINE)

    def parse(self, text: str):
        """The flag's value; argparse then says why one does not parse."""
        try:
            return self._parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{self.flag}: {exc}") from None

    def _parse(self, text: str):
        parse = self.cli.get("parse")
        if parse == "bytes":
            return parse_bytes(text)
        if parse == "port_or_off":
            return None if text.strip().lower() in ("off", "none", "no") else int(text)
        return self.kind(text)

    def help(self) -> str:
        if "default_text" in self.cli:
            return f"{self.description} (default: {self.cli['default_text']})"
        default = self.cli.get("command_default", self.default)
        if self.cli.get("parse") == "bytes":
            default = _bytes_text(default)
        elif isinstance(default, bool):
            default = "on" if default else "off"
        elif isinstance(default, float):
            default = f"{default:g}"
        return f"{self.description} (default {default})"

    def add_to(self, group) -> None:
        names = [self.flag, *self.cli.get("aliases", ())]
        if self.kind is bool:
            group.add_argument(*names, dest=self.dest, action=argparse.BooleanOptionalAction,
                               default=None, help=self.help())  # fmt: skip
            return
        default = self.cli.get("command_default")
        env = self.cli.get("env")
        if env is not None:
            text = env_default(env)
            default = default if text is None else self.parse(text)
        metavar = None if "choices" in self.cli else self.flag[2:].upper().replace("-", "_")
        group.add_argument(*names, dest=self.dest, type=self.parse, default=default,
                           choices=self.cli.get("choices"), metavar=metavar,
                           help=self.help())  # fmt: skip


def setting_flags() -> list[SettingFlag]:
    """One flag per EngineConfig field that has a setting (placement-internal fields have
    none), in field order."""
    hints = typing.get_type_hints(EngineConfig, include_extras=True)
    flags = []
    for field in msgspec.structs.fields(EngineConfig):
        metas = [
            m for m in getattr(hints[field.name], "__metadata__", ()) if isinstance(m, msgspec.Meta)
        ]
        if not metas:
            continue
        kind = _scalar(typing.get_args(hints[field.name])[0])
        flags.append(
            SettingFlag(field.name, kind, field.default, metas[0].description, metas[0].extra or {})
        )
    return flags


def add_setting_flags(parser: argparse.ArgumentParser, *, serving: bool = False) -> None:
    """The engine's flags (and, for a command that serves, the servers')."""
    groups = {ENGINE: parser.add_argument_group(ENGINE)}
    if serving:
        groups[SERVER] = parser.add_argument_group(SERVER)
    for flag in setting_flags():
        if flag.group in groups:
            flag.add_to(groups[flag.group])


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The settings the command line gives; what it leaves out keeps EngineConfig's default.
    A flag whose parsed value is None was given as "off" (the HTTP port) when the command
    defaults it to something else. A command without the server flags binds its engine's
    gRPC server to a free port (it talks to it itself)."""
    given = {} if hasattr(args, "port") else {"port": 0}
    for flag in setting_flags():
        if not hasattr(args, flag.dest):
            continue
        value = getattr(args, flag.dest)
        if value is not None or "command_default" in flag.cli:
            given[flag.field] = value
    return EngineConfig(**given)


def config_of_settings(settings: dict) -> EngineConfig:
    """The settings of a mapping such as a Serve application's ``args``: each key a
    ``kvray serve`` flag without its dashes (``tensor-parallel-size`` or
    ``tensor_parallel_size``), each value what the flag takes (True/False for on/off flags),
    read exactly as the command line would be, ``KVRAY_*`` defaults included."""
    parser = argparse.ArgumentParser(prog="kvray serve args", add_help=False, exit_on_error=False)
    add_setting_flags(parser, serving=True)
    words = []
    for key, value in settings.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [flag, str(value)]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args, unknown = parser.parse_known_args(words)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"kvray settings: {errors.getvalue().strip() or exc}") from None
    if unknown:
        raise ValueError(f"kvray settings: no such setting(s): {' '.join(unknown)}")
    return engine_config(args)


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default=env_default("KVRAY_LOG_LEVEL", "INFO"),
        help="DEBUG, INFO, WARNING or ERROR (default INFO)",
    )


def add_server_address(parser: argparse.ArgumentParser, *, what: str) -> None:
    """--server and --api-key of a command that can talk to a running server."""
    parser.add_argument("--server", default=None, help=f"HOST:PORT of a running server ({what})")
    parser.add_argument("--api-key", default=env_default("KVRAY_API_KEY"))


def add_in_process_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run one rank in this process instead of on Ray (TP 1 only; faster to start; "
        "the figures then include the client's share of this interpreter)",
    )


def _scalar(annotation) -> type:
    """int, float, str or bool, out of ``X`` or ``X | None``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return annotation


def _bytes_text(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return str(size)
