"""ServerArgs on the command line: every option typed from its field's resolved
annotation (bool flags both ways, ``Optional[X]`` as ``X``, ``Literal`` as
choices), every spelling the docs and tests use still accepted, and a bad value
an argparse error that names the flag."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal, Optional

import pytest

from radixserve.cli_args import cli_type
from radixserve.config import DTYPES, SCHEDULE_POLICIES, ServerArgs, _flag


def parser_for(cls: type[ServerArgs] = ServerArgs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve serve")
    cls.add_cli_args(parser)
    return parser


def parse(*argv: str, cls: type[ServerArgs] = ServerArgs) -> ServerArgs:
    return cls.from_cli_args(parser_for(cls).parse_args(list(argv)))


def test_defaults_are_the_dataclass_defaults():
    assert parse() == ServerArgs()


@pytest.mark.parametrize(
    "argv,expected",
    [
        ([], None),  # unset: the platform and the backends decide
        (["--disable-graph"], True),
        (["--no-disable-graph"], False),  # insists on graphs
        (["--disable-cuda-graph"], True),  # SGLang's spelling
        (["--no-disable-cuda-graph"], False),
        (["--disable-graph", "--no-disable-graph"], False),  # the last one wins
    ],
)
def test_an_unset_boolean_can_be_set_either_way(argv, expected):
    assert parse(*argv).disable_graph is expected


@pytest.mark.parametrize(
    "name",
    ["disable_overlap_schedule", "disable_radix_cache", "log_requests", "skip_server_warmup"],
)
def test_every_boolean_flag_has_a_negative_form(name):
    flag = "--" + name.replace("_", "-")
    assert getattr(parse(flag), name) is True
    assert getattr(parse(flag, "--no-" + flag[2:]), name) is False


def test_values_parse_to_the_fields_types():
    args = parse(
        "--max-total-tokens",
        "4096",  # Optional[int]
        "--mem-fraction-static",
        "0.5",  # Optional[float]
        "--schedule-conservativeness",
        "2",  # float, given as an int
        "--port",
        "0",
        "--dtype",
        "bfloat16",  # Literal
        "--schedule-policy",
        "lpm",
        "--chunked-prefill-size",
        "-1",
        "--model-path",
        "/models/x",  # the alias of --model
    )
    assert (args.max_total_tokens, type(args.max_total_tokens)) == (4096, int)
    assert (args.mem_fraction_static, type(args.mem_fraction_static)) == (0.5, float)
    assert (args.schedule_conservativeness, type(args.schedule_conservativeness)) == (2.0, float)
    assert (args.port, args.dtype, args.schedule_policy, args.chunk_size) == (0, "bfloat16", "lpm", None)
    assert args.model_path == "/models/x"


def test_literal_fields_offer_their_values_as_choices():
    actions = {a.dest: a for a in parser_for()._actions}
    assert tuple(actions["dtype"].choices) == DTYPES == typing.get_args(typing.get_type_hints(ServerArgs)["dtype"])
    assert tuple(actions["kv_cache_dtype"].choices) == DTYPES
    assert tuple(actions["schedule_policy"].choices) == SCHEDULE_POLICIES
    assert tuple(actions["backend_selection"].choices) == ("measure", "priority")


def test_every_field_is_typed_from_its_annotation():
    hints = typing.get_type_hints(ServerArgs)
    actions = {a.dest: a for a in parser_for()._actions}
    for f in dataclasses.fields(ServerArgs):
        kind, _ = cli_type("ServerArgs", f.name, hints[f.name])
        if kind is bool:
            assert isinstance(actions[f.name], argparse.BooleanOptionalAction), f.name
        else:  # a list's values are strings
            assert actions[f.name].type is (str if kind is list else kind), f.name


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--max-total-tokens", "4k"], "argument --max-total-tokens: invalid int value: '4k'"),
        (["--mem-fraction-static", "half"], "argument --mem-fraction-static: invalid float value: 'half'"),
        (["--port", "http"], "argument --port: invalid int value: 'http'"),
        (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        (["--schedule-policy", "lifo"], "argument --schedule-policy: invalid choice: 'lifo'"),
        (["--disable-graph", "yes"], "unrecognized arguments: yes"),
    ],
)
def test_a_bad_value_is_an_argparse_error_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parser_for().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# Annotations the old string guessing got wrong: PEP 604 unions and non-str Literals.
@dataclass
class ExtendedArgs(ServerArgs):
    block_count: int | None = _flag("an int or unset", default=None)
    split: Literal[1, 2, 4] = _flag("an int with choices", default=1)
    ratio: float | None = _flag("a float or unset", default=None)
    eager: bool | None = _flag("a bool or unset", default=None)


def test_types_come_from_resolved_annotations_not_their_spelling():
    args = parse("--block-count", "7", "--split", "4", "--ratio", "0.25", "--no-eager", cls=ExtendedArgs)
    assert (args.block_count, args.split, args.ratio, args.eager) == (7, 4, 0.25, False)
    assert type(args.block_count) is int and type(args.split) is int
    with pytest.raises(SystemExit):
        parser_for(ExtendedArgs).parse_args(["--split", "3"])


@pytest.mark.parametrize(
    "annotation",
    [list[int], Optional[list[int]], typing.Union[int, str, None], Literal["a", 1], Literal[True]],  # noqa: UP007, UP045 (the old spellings)
)
def test_an_annotation_without_a_command_line_form_is_an_error_naming_the_field(annotation):
    with pytest.raises(TypeError, match=r"ServerArgs\.extra: no command-line form"):
        cli_type("ServerArgs", "extra", annotation)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(dp_size=0), "dp_size"),
        (dict(dp_size=2, nnodes=2, tp_size=2, dist_init_addr="127.0.0.1:5000"), "dp_size"),
        (dict(load_balance_method="random"), "load_balance_method"),
        (dict(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:5000"), "nnodes"),
    ],
)
def test_parallel_settings_that_cannot_run_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        ServerArgs(**kwargs)
