"""The request models (torpor.sandbox.requests): bounds that match the engine, typed errors,
"None means not given", and what the SDK sends surviving the trip to the server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torpor.errors import InvalidArgument, InvalidName, PayloadTooLarge, TorporError
from torpor.sandbox.requests import (
    MAX_ARG_BYTES,
    MAX_ENV_BYTES,
    MAX_LABEL_KEY,
    MAX_LABEL_VALUE,
    MAX_LABELS,
    MAX_MEMORY_MIB,
    MAX_MOUNTS,
    MAX_VCPUS,
    MIN_MEMORY_MIB,
    CodeSpec,
    CommandSpec,
    DriveMount,
    ForkSpec,
    SandboxOptions,
    SandboxSpec,
    VolumeMount,
)
from torpor.sandbox.template import TemplateInfo
from torpor.sandbox.vm.machine import MachineSpec
from torpor.sandbox.vm.machine_dir import new_machine_config


def _machine_config_accepts(tmp_path: Path, **spec: int) -> bool:
    template = TemplateInfo(
        name="t",
        directory=tmp_path,
        build_id="b",
        kernel=tmp_path / "vmlinuz",
        initrd=tmp_path / "initrd.img",
        base_image=tmp_path / "base.qcow2",
        snapshot_dir=tmp_path / "snap",
    )
    try:
        new_machine_config(template, MachineSpec(**spec), "tcg")  # type: ignore[arg-type]
    except InvalidArgument:
        return False
    return True


def _options_accept(**fields: int) -> bool:
    try:
        SandboxOptions.of(**fields)
    except InvalidArgument:
        return False
    return True


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"memory_mib": MIN_MEMORY_MIB - 1}, id="memory-below"),
        pytest.param({"memory_mib": MIN_MEMORY_MIB}, id="memory-min"),
        pytest.param({"memory_mib": MAX_MEMORY_MIB}, id="memory-max"),
        pytest.param({"memory_mib": MAX_MEMORY_MIB + 1}, id="memory-above"),
        pytest.param({"memory_mib": 1024 * 1024}, id="memory-1-tib"),
        pytest.param({"vcpus": 0}, id="vcpus-0"),
        pytest.param({"vcpus": MAX_VCPUS}, id="vcpus-max"),
        pytest.param({"vcpus": MAX_VCPUS + 1}, id="vcpus-above"),
    ],
)
def test_machine_sizes_are_the_engines(tmp_path: Path, fields: dict[str, int]) -> None:
    """A sandbox may ask for exactly the machines the engine can build: one range."""
    assert _options_accept(**fields) == _machine_config_accepts(tmp_path, **fields)


def test_none_means_not_given_unless_it_means_something() -> None:
    spec = SandboxSpec.of(template=None, name=None, labels=None, vcpus=None, volumes=None)
    assert spec.given() == {}
    assert (spec.template, spec.vcpus, spec.volumes) == ("python", 1, [])
    no_limit = CommandSpec.of("sleep 1000", timeout=None, cwd=None)
    assert no_limit.timeout is None  # None is "no limit" here, not "the default 60 s"
    assert no_limit.given() == {"cmd": "sleep 1000", "timeout": None}
    assert CommandSpec.of("true").timeout == 60.0


@pytest.mark.parametrize(
    ("make", "error"),
    [
        pytest.param(lambda: SandboxSpec.of(name="Not OK"), InvalidName, id="sandbox-name"),
        pytest.param(lambda: SandboxSpec.of(template="No Such"), InvalidName, id="template"),
        pytest.param(lambda: SandboxSpec.of(name="agent\n"), InvalidName, id="name-newline"),
        pytest.param(lambda: ForkSpec.of(count=2, names=["a", "B"]), InvalidName, id="fork-name"),
        pytest.param(lambda: ForkSpec.of(count=2, names=["a"]), InvalidArgument, id="names"),
        pytest.param(lambda: ForkSpec.of(count=0), InvalidArgument, id="fork-count"),
        pytest.param(
            lambda: SandboxSpec.of(volumes=[{"volume": "v", "path": "/etc"}]),
            InvalidArgument,
            id="system-mount",
        ),
        pytest.param(
            lambda: SandboxSpec.of(drives=[{"drive": "d", "path": f"/m{i}"} for i in range(25)]),
            InvalidArgument,
            id="too-many-mounts",
        ),
        pytest.param(lambda: SandboxSpec.of(colour="red"), InvalidArgument, id="unknown-field"),
        pytest.param(
            lambda: CommandSpec.of("x" * (MAX_ARG_BYTES + 1)), PayloadTooLarge, id="long-command"
        ),
        pytest.param(
            lambda: CommandSpec.of("true", env={"BIG": "x" * MAX_ARG_BYTES}),
            PayloadTooLarge,
            id="long-env-var",
        ),
        pytest.param(
            lambda: CommandSpec.of(
                "true", env={f"V{i}": "x" * 1000 for i in range(MAX_ENV_BYTES // 1000)}
            ),
            PayloadTooLarge,
            id="big-env",
        ),
        pytest.param(lambda: CodeSpec.of("x" * (17 << 20)), PayloadTooLarge, id="big-code"),
        # JSON can carry a lone surrogate, UTF-8 cannot: the channel's encode was a raw
        # UnicodeEncodeError (a 500 from the interpreter routes)
        pytest.param(lambda: CodeSpec.of("x = '\ud800'"), InvalidArgument, id="code-surrogate"),
        # the guest's select() cannot wait that long: a raw OverflowError in the guest
        pytest.param(
            lambda: CommandSpec.of("true", timeout=float("inf")), InvalidArgument, id="inf-timeout"
        ),
        pytest.param(
            lambda: CodeSpec.of("1", timeout=1e30), InvalidArgument, id="code-timeout-too-long"
        ),
    ],
)
def test_typed_errors(make: Any, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        make()
    assert type(info.value) is error


def test_mounts_are_normalized_and_counted_together() -> None:
    spec = SandboxSpec.of(
        volumes=[VolumeMount(volume="v", path="/memory/")],
        drives=[{"drive": "d", "path": "/shared//x", "read_only": True}],
    )
    assert spec.volumes[0].path == "/memory" and spec.drives == [
        DriveMount(drive="d", path="/shared/x", read_only=True)
    ]
    assert not spec.plain and SandboxSpec.of(name="a").plain
    half = MAX_MOUNTS // 2
    SandboxSpec.of(
        volumes=[{"volume": "v", "path": f"/v{i}"} for i in range(half)],
        drives=[{"drive": "d", "path": f"/d{i}"} for i in range(MAX_MOUNTS - half)],
    )


def test_narrowing_keeps_what_was_set() -> None:
    spec = SandboxSpec.of(name="a", vcpus=2, volumes=[{"volume": "v", "path": "/m"}])
    assert spec.narrow(SandboxOptions).given() == {"name": "a", "vcpus": 2}
    with pytest.raises(InvalidArgument, match="volumes"):
        SandboxOptions.of(spec)  # the manager makes no mounts: it says so, never drops them
    options = SandboxOptions.of(vcpus=2)
    assert SandboxOptions.of(options) is options
    assert options.named("agent").given() == {"vcpus": 2, "name": "agent"}
    with pytest.raises(InvalidArgument):
        SandboxOptions.of(name="other").named("agent")


_label_keys = st.text(
    st.characters(exclude_characters="=", exclude_categories=["Cs"]),
    min_size=1,
    max_size=MAX_LABEL_KEY,
)
_labels = st.dictionaries(
    _label_keys,
    st.text(st.characters(exclude_categories=["Cs"]), max_size=MAX_LABEL_VALUE),
    max_size=MAX_LABELS,
)


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "name": st.from_regex(r"\A[a-z0-9][a-z0-9._-]{0,62}\Z"),
            "labels": _labels,
            "idle_pause_seconds": st.integers(1, 10**6),
            "vcpus": st.integers(1, MAX_VCPUS),
            "memory_mib": st.integers(MIN_MEMORY_MIB, MAX_MEMORY_MIB),
            "pause_retention_days": st.integers(1, 365),
            "snapshot": st.text(min_size=1, max_size=20),
        },
    )
)
def test_what_the_sdk_sends_the_server_reads_back(fields: dict[str, Any]) -> None:
    spec = SandboxSpec.of(**fields)
    wire = spec.given()
    assert set(wire) == set(fields)
    back = SandboxSpec.model_validate(wire)
    assert back == spec and back.model_fields_set == spec.model_fields_set


@pytest.mark.parametrize(
    "user",
    [
        pytest.param("jordan@example.com", id="email"),
        pytest.param("auth0|123", id="auth0"),
        pytest.param("U42", id="upper"),
        pytest.param("名前 with spaces/and:colons", id="unicode"),
        pytest.param("x" * 256, id="256-chars"),
    ],
)
def test_user_ids_as_they_come_are_label_values(user: str) -> None:
    from torpor.sandbox.requests import SandboxSpec

    assert SandboxSpec.of(labels={"user": user}).labels == {"user": user}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param(
            {"labels": {"user": "x" * 257}},
            "invalid sandbox spec: labels.user is longer than 256 characters",
            id="long-value",
        ),
        pytest.param(
            {"labels": {"a=b": "c"}},
            "invalid sandbox spec: labels key 'a=b' must not contain '='",
            id="key-with-equals",
        ),
        pytest.param(
            {"vcpus": 0, "bogus": 1},
            "invalid sandbox spec: vcpus must be at least 1; bogus is not an option here",
            id="two-problems",
        ),
        pytest.param(
            {"name": "Jordan Smith"},
            "invalid sandbox name 'Jordan Smith': use 1-63 characters of a-z, 0-9, '.', '_' "
            "and '-', starting with a letter or digit",
            id="name",
        ),
    ],
)
def test_one_clean_message(fields: dict[str, Any], message: str) -> None:
    from torpor.sandbox.requests import SandboxSpec

    with pytest.raises(TorporError) as err:
        SandboxSpec.of(**fields)
    assert str(err.value) == message
