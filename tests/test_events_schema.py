"""Each event class (rollbus/events/records.py) agrees with its newest schema (schemas/<event>.avsc): the same
fields in the same order, each of the same type, optional exactly when the schema allows null, with the
schema's default; nested records and enums likewise. And the dict boundary keeps every field."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

from rollbus.codec import schema
from rollbus.events import EVENT_CLASSES, EVENT_TYPES, EventRecord, Record, RewardEvent, TurnEvent

SCALARS = {"int": int, "long": int, "float": float, "double": float, "boolean": bool, "string": str,
           "bytes": bytes}  # fmt: skip


def type_problems(hint: Any, avro: Any, where: str) -> list[str]:
    """How ``hint`` (a resolved annotation) differs from the Avro type ``avro``."""
    if isinstance(avro, list):
        branches = [b for b in avro if b != "null"]
        args = typing.get_args(hint)
        if "null" not in avro or len(branches) != 1:
            return [f"{where}: unsupported union {avro}"]
        if type(None) not in args:
            return [f"{where}: the schema allows null, the class does not"]
        (rest,) = [a for a in args if a is not type(None)] or [None]
        return type_problems(rest, branches[0], where)
    if type(None) in typing.get_args(hint):
        return [f"{where}: the class allows None, the schema does not"]
    if isinstance(avro, str) and avro in SCALARS:
        return [] if hint is SCALARS[avro] else [f"{where}: {hint} is not Avro {avro}"]
    kind = avro.get("type") if isinstance(avro, dict) else None
    if kind == "enum":
        ok = typing.get_origin(hint) is Literal and list(typing.get_args(hint)) == avro["symbols"]
        return [] if ok else [f"{where}: {hint} is not the enum {avro['symbols']}"]
    if kind == "array":
        if typing.get_origin(hint) is not Sequence:
            return [f"{where}: {hint} is not a Sequence"]
        return type_problems(typing.get_args(hint)[0], avro["items"], f"{where}[]")
    if kind == "record":
        if not (isinstance(hint, type) and issubclass(hint, Record)):
            return [f"{where}: {hint} is not a record class"]
        return disagreements(hint, avro)
    return [f"{where}: unsupported Avro type {avro}"]


def disagreements(cls: type[Record], declared: dict[str, Any]) -> list[str]:
    """Every way ``cls`` differs from the Avro record ``declared`` (empty: they agree)."""
    fields = [f for f in declared["fields"] if f["name"] != "schema_version"]
    mine = dataclasses.fields(cls)
    if [f.name for f in mine] != [f["name"] for f in fields]:
        return [f"{cls.__name__} fields {[f.name for f in mine]} != schema's {[f['name'] for f in fields]}"]
    hints = typing.get_type_hints(cls)
    problems = []
    for field, avro in zip(mine, fields, strict=True):
        where = f"{cls.__name__}.{field.name}"
        problems += type_problems(hints[field.name], avro["type"], where)
        has_default = (field.default, field.default_factory) != (dataclasses.MISSING, dataclasses.MISSING)
        if has_default != ("default" in avro):
            side = "the class" if has_default else "the schema"
            problems.append(f"{where}: default in {side} only")
        elif has_default:
            factory = field.default_factory
            value = factory() if callable(factory) else field.default
            value = list(value) if isinstance(value, tuple) else value
            if value != avro["default"] or type(value) is not type(avro["default"]):
                problems.append(f"{where}: default {value!r} != the schema's {avro['default']!r}")
    return problems


def test_every_event_class_agrees_with_its_newest_schema() -> None:
    assert tuple(c.event_type for c in EVENT_CLASSES) == EVENT_TYPES
    for cls in EVENT_CLASSES:
        declared = schema(cls.event_type)
        assert cls.__name__ == declared["name"] + "Event"
        assert disagreements(cls, declared) == [], cls.__name__


def test_the_check_catches_a_class_that_drifted() -> None:
    """The check above is not vacuous: each kind of drift from the reward schema is named."""
    declared = schema("reward")
    hints = typing.get_type_hints(RewardEvent)
    base = {f.name: (hints[f.name], f) for f in dataclasses.fields(RewardEvent)}

    def drifted(name: str, hint: Any, **default: Any) -> type[Record]:
        fields = [(n, h if n != name else hint, f if n != name else dataclasses.field(**default))
                  for n, (h, f) in base.items()]  # fmt: skip
        return dataclasses.make_dataclass(
            "RewardEvent", fields, bases=(EventRecord,), frozen=True, kw_only=True
        )

    assert disagreements(drifted("group_size", int, default=2), declared) == [
        "RewardEvent.group_size: default 2 != the schema's 1"]  # fmt: skip
    assert disagreements(drifted("failure_kind", str, default=None), declared) == [
        "RewardEvent.failure_kind: the schema allows null, the class does not"]  # fmt: skip
    assert disagreements(drifted("at", Optional[int]), declared) == [  # noqa: UP045 (make_dataclass's hint)
        "RewardEvent.at: the class allows None, the schema does not"]  # fmt: skip
    assert disagreements(drifted("reward", float, default=0.0), declared) == [
        "RewardEvent.reward: default in the class only"]  # fmt: skip

    @dataclass(frozen=True, kw_only=True)
    class Short(Record):
        rollout_id: str

    assert disagreements(Short, declared)[0].startswith("Short fields ['rollout_id'] != schema's")


def test_the_dict_boundary_keeps_every_field_and_names_what_does_not_fit() -> None:
    record = {"rollout_id": "r1", "chain_id": "main", "chain_kind": "main", "turn_index": 0,
              "prompt_ids": [1, 2], "prompt_tokens": 2, "output_ids": [3], "output_logprobs": [-0.5],
              "finish_reason": "stop", "policy_version": 4, "request_id": "q",
              "timings": {"started_at": 1, "finished_at": 2, "generation_ms": 1},
              "routed_experts": {"digest": "d", "dtype": "uint8", "start": 0, "rows": 2,
                                 "width": 8}}  # fmt: skip
    turn = TurnEvent.from_dict({**record, "schema_version": 4})
    assert turn.timings.finished_at == 2 and turn.routed_experts and turn.routed_experts.width == 8
    defaults = {"attempt_id": "", "prompt_ref_turn": None, "output_top_logprobs": None}
    assert turn.to_dict() == {**record, **defaults}
    assert TurnEvent.from_dict(turn) is turn
    for bad, named in (({**record, "turn_idx": 1}, "turn_idx"), ({"rollout_id": "r"}, "chain_id"),
                       ({**record, "timings": {"started_at": 1}}, "finished_at")):  # fmt: skip
        try:
            TurnEvent.from_dict(bad)
        except ValueError as exc:
            assert named in str(exc)
        else:
            raise AssertionError(f"{named} was accepted")
