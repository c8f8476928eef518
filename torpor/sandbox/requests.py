"""Every request torpor takes, declared once: one pydantic model per request, whose fields carry
their bounds and defaults.

Each layer uses the same class, so a value is refused the same way wherever it enters:

* the SDK (:mod:`torpor.client`) builds the model and posts
  ``model.model_dump(mode="json", exclude_unset=True)``;
* the server's routes take it as their body (the OpenAPI document is generated from it);
* the library entry points (:class:`~torpor.sandbox.manager.SandboxManager`,
  :class:`~torpor.sandbox.checkpoints.Checkpoints`, the volume and drive stores, the guest
  channel) take the model, or keyword arguments they turn into it with :meth:`Spec.of`.

::

    SandboxSpec        POST /v1/sandboxes                     Sandbox.create, Checkpoints.create
    └── SandboxOptions PUT  /v1/sandboxes/by-name/{name}      SandboxManager.create, get_or_create
        └── RestoreSpec POST /v1/snapshots/{id}/restore       Checkpoints.restore
    VolumeMount        SandboxSpec.volumes, POST /v1/sandboxes/{id}/volumes
    DriveMount         SandboxSpec.drives,  POST /v1/sandboxes/{id}/drives
    CommandSpec        POST /v1/sandboxes/{id}/commands[/stream]     run_command
    CodeSpec           POST /v1/sandboxes/{id}/interpreter[/stream]  run_code
    SnapshotSpec       POST /v1/sandboxes/{id}/snapshots             Checkpoints.snapshot
    ForkSpec           POST /v1/sandboxes/{id}/fork, /v1/snapshots/{id}/fork
    VolumeSpec         POST /v1/volumes                              VolumeStore.create
    DriveSpec          POST /v1/drives                               DriveStore.create
    GcSpec             POST /v1/gc                                   Checkpoints.collect_garbage

Errors: a bad value raises :class:`~torpor.errors.InvalidArgument` (HTTP 400) naming every bad
field; a name that breaks :func:`torpor.config.check_name` raises
:class:`~torpor.errors.InvalidName`, a bad mount path the ``InvalidArgument`` of
:func:`~torpor.sandbox.storage.records.check_mount_path`, and a command, environment or code
over its size :class:`~torpor.errors.PayloadTooLarge` (413) — those three straight from validation.
Unknown fields are refused. ``None`` for a field that cannot be None, or whose default is None
anyway, means "not given" (so the SDK can pass its keyword arguments through as they are).
"""

from __future__ import annotations

import posixpath
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import (
    Annotated,
    Any,
    ClassVar,
    Literal,
    Self,
    TypeVar,
    Union,
    get_args,
    get_origin,
)

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from torpor.config import LIMITS, NAME_RE, check_name
from torpor.errors import InvalidArgument, PayloadTooLarge

#: guest directories a volume or drive may not be mounted on or under
SYSTEM_DIRS = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/opt",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/sys",
    "/tmp",
    "/usr",
    "/var",
)


#: the longest guest path the file calls take (Linux's PATH_MAX)
MAX_GUEST_PATH = 4095


def check_guest_path(path: object, *, removing: bool = False) -> str:
    """A path the file calls may use in a guest, or InvalidArgument: a non-empty string of at
    most :data:`MAX_GUEST_PATH` characters without NUL. ``removing``: also absolute, and never
    ``/``, a system directory (:data:`SYSTEM_DIRS`) or a directory right under one (``/usr/lib``)
    — removing those wipes the guest's OS, not a file of the agent's."""
    if not isinstance(path, str) or not path or len(path) > MAX_GUEST_PATH:
        raise InvalidArgument(
            f"a guest path must be 1-{MAX_GUEST_PATH} characters, not {str(path)[:80]!r}",
            field="path",
        )
    if "\0" in path:
        raise InvalidArgument("a guest path must not contain NUL", field="path", value=path)
    if removing:
        if not path.startswith("/"):
            raise InvalidArgument(
                f"remove needs an absolute guest path, not {path!r}", field="path", value=path
            )
        norm = posixpath.normpath(path).replace("//", "/", 1)
        if norm == "/" or norm in SYSTEM_DIRS or posixpath.dirname(norm) in SYSTEM_DIRS:
            raise InvalidArgument(
                f"refusing to remove {path!r}: it is (or is right under) a system directory of "
                "the guest; remove the files of yours inside it instead",
                field="path",
                value=path,
            )
    return path


def check_mount_path(path: str) -> str:
    """Return the normalized absolute guest path, or raise InvalidArgument.

    Refuses relative paths, ``..``, ``/`` and anything on or under a system directory.
    """
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidArgument(
            f"mount path must be an absolute guest path, not {path!r}",
            field="path",
            value=str(path),
        )
    if ".." in path.split("/"):
        raise InvalidArgument(f"mount path {path!r} may not contain '..'", field="path", value=path)
    norm = posixpath.normpath(path)
    if norm.startswith("//"):
        norm = norm[1:]
    for system in SYSTEM_DIRS:
        if norm == "/" or norm == system or norm.startswith(system + "/"):
            shown = system if norm != "/" else "/"
            raise InvalidArgument(
                f"mount path {path!r} collides with the system directory {shown}"
                "; use a path such as /memory, /data or /mnt/<name>",
                field="path",
                value=path,
            )
    return norm


__all__ = [
    "COMMAND_TIMEOUT",
    "MAX_ARG_BYTES",
    "MAX_ENV_BYTES",
    "MAX_ENV_VARS",
    "MAX_IDLE_PAUSE_SECONDS",
    "MAX_LABELS",
    "MAX_LABEL_KEY",
    "MAX_LABEL_VALUE",
    "MAX_MEMORY_MIB",
    "MAX_MOUNTS",
    "MAX_PATH",
    "MAX_RETENTION_DAYS",
    "MAX_VCPUS",
    "MAX_VOLUME_MIB",
    "MIN_MEMORY_MIB",
    "MIN_VOLUME_MIB",
    "CodeSpec",
    "CommandSpec",
    "DriveMount",
    "DriveSpec",
    "ForkSpec",
    "GcSpec",
    "PtySize",
    "PtySpec",
    "RestoreSpec",
    "SandboxOptions",
    "SandboxSettings",
    "SandboxSpec",
    "SnapshotSpec",
    "Spec",
    "VolumeMount",
    "VolumeSpec",
    "invalid_argument",
]

# -- bounds ----------------------------------------------------------------------------------

#: vCPUs of a machine
MAX_VCPUS = 64
#: MiB of RAM of a machine: below 128 the guest kernel and agent do not come up; 64 GiB is
#: far past what a sandbox's RAM file (copied on every fork) should be
MIN_MEMORY_MIB = 128
MAX_MEMORY_MIB = 64 * 1024
#: days a paused sandbox or a snapshot is kept
MAX_RETENTION_DAYS = 365
#: a longer idle time is "never" (None); the registry stores it as a 64-bit integer
MAX_IDLE_PAUSE_SECONDS = MAX_RETENTION_DAYS * 86400
#: labels of one sandbox or snapshot, and the length of a key and of a value
MAX_LABELS = 64
MAX_LABEL_KEY = 63
MAX_LABEL_VALUE = 256
#: Linux's MAX_ARG_STRLEN less the NUL: the longest argument (the command) or ``KEY=VALUE``
#: that exec takes
MAX_ARG_BYTES = 128 * 1024 - 1
#: the environment of one command, all ``KEY=VALUE`` strings together (well inside exec's
#: ARG_MAX and the guest protocol's 1 MiB header), and the number of variables
MAX_ENV_BYTES = 256 * 1024
MAX_ENV_VARS = 1024
#: PATH_MAX less the NUL
MAX_PATH = 4095
#: volumes + drives of one sandbox: the machine's hot-plug PCI slots (8-31, see
#: :mod:`torpor.sandbox.vm.machine_dir`)
MAX_MOUNTS = 24
#: seconds a command may run when the caller does not say (None: no limit)
COMMAND_TIMEOUT = 60.0
#: MiB of a volume: 16 MiB holds an ext4 journal; 1 TiB costs nothing until written (sparse)
MIN_VOLUME_MIB = 16
MAX_VOLUME_MIB = 1024 * 1024


# -- errors ----------------------------------------------------------------------------------


#: what a pattern of this module means, said in words
_PATTERN_WORDS = {
    r"^[^=]+$": "must not contain '='",
    r"^[^=\x00]+$": "must not contain '=' or a NUL character",
    r"^[^\x00]*$": "must not contain a NUL character",
}


def _words(name: str) -> str:
    """``"SandboxSpec"`` -> ``"sandbox spec"``."""
    return re.sub(r"(?<!^)(?=[A-Z])", " ", name).lower()


def _problem(e: Mapping[str, Any]) -> str:
    """One validation problem in plain words: where, then what is wrong."""
    loc = [str(p) for p in e.get("loc", ())]
    ctx = e.get("ctx") or {}
    kind = str(e.get("type", ""))
    if loc and loc[-1] == "[key]":  # a dict key: labels.a=b.[key] -> labels key 'a=b'
        where = f"{'.'.join(loc[:-2])} key {loc[-2]!r}".strip() if len(loc) >= 2 else "key"
    else:
        where = ".".join(loc)
    words = {
        "string_pattern_mismatch": _PATTERN_WORDS.get(
            str(ctx.get("pattern", "")), "has characters that are not allowed"
        ),
        "string_too_long": f"is longer than {ctx.get('max_length')} characters",
        "string_too_short": "must not be empty"
        if ctx.get("min_length") == 1
        else f"is shorter than {ctx.get('min_length')} characters",
        "too_long": f"has more than {ctx.get('max_length')} items",
        "greater_than_equal": f"must be at least {ctx.get('ge')}",
        "greater_than": f"must be more than {ctx.get('gt')}",
        "less_than_equal": f"must be at most {ctx.get('le')}",
        "extra_forbidden": "is not an option here",
        "missing": "is required",
    }.get(kind, str(e.get("msg", "")))
    return f"{where} {words}" if where else words


def invalid_argument(errors: Sequence[Mapping[str, Any]], what: str) -> InvalidArgument:
    """One :class:`InvalidArgument` for pydantic's ``errors`` (every bad field, with its
    ``loc`` and ``msg`` in ``.problems``), said in plain words (``labels key 'a=b' must not
    contain '='``). The server's handler of bad bodies uses it too."""
    problems: list[dict[str, Any]] = []
    lines: list[str] = []
    for e in errors:
        loc, msg = [str(p) for p in e.get("loc", ())], str(e.get("msg", ""))
        problems.append({"loc": loc, "msg": msg})
        line = _problem(e)
        if line not in lines:
            lines.append(line)
    return InvalidArgument(f"{what}: {'; '.join(lines)}", problems=problems)


# -- field types -----------------------------------------------------------------------------


#: the JSON schema of a name (the check itself raises InvalidName, not a validation error)
_NAME_SCHEMA = Field(json_schema_extra={"pattern": NAME_RE.pattern})


def _max_bytes(limit: int, what: str, size: Callable[[Any], int]) -> AfterValidator:
    """Refuse a value whose ``size`` is over ``limit`` bytes with PayloadTooLarge."""

    def check(value: Any) -> Any:
        n = size(value)
        if n > limit:
            raise PayloadTooLarge(f"{what} of {n} bytes is over the limit", size=n, limit=limit)
        return value

    return AfterValidator(check)


def _utf8(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


def _unicode(what: str) -> AfterValidator:
    """Refuse a string with a lone surrogate (JSON can carry ``"\\ud800"``; it has no UTF-8
    form, so it could never be sent to the guest) as a validation error."""

    def check(value: str) -> str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{what} is not valid Unicode (a lone surrogate at position {exc.start})"
            ) from None
        return value

    return AfterValidator(check)


def _env_bytes(env: Mapping[str, str]) -> int:
    for key, value in env.items():  # each KEY=VALUE is one exec string
        n = _utf8(key) + 1 + _utf8(value)
        if n > MAX_ARG_BYTES:
            raise PayloadTooLarge(
                f"environment variable {key[:40]!r} of {n} bytes is over the limit",
                size=n,
                limit=MAX_ARG_BYTES,
            )
    return sum(_utf8(k) + _utf8(v) + 2 for k, v in env.items())


SandboxName = Annotated[str, AfterValidator(lambda v: check_name(v, "sandbox name")), _NAME_SCHEMA]
TemplateName = Annotated[
    str, AfterValidator(lambda v: check_name(v, "template name")), _NAME_SCHEMA
]
SnapshotName = Annotated[
    str, AfterValidator(lambda v: check_name(v, "snapshot name")), _NAME_SCHEMA
]
VolumeName = Annotated[str, AfterValidator(lambda v: check_name(v, "volume name")), _NAME_SCHEMA]
DriveName = Annotated[str, AfterValidator(lambda v: check_name(v, "drive name")), _NAME_SCHEMA]

#: ``{"user": "u-42"}``: keys without ``=`` (``?label=KEY=VALUE`` must be able to name them)
Labels = Annotated[
    dict[
        Annotated[
            str, StringConstraints(min_length=1, max_length=MAX_LABEL_KEY, pattern=r"^[^=]+$")
        ],
        Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE)],
    ],
    Field(max_length=MAX_LABELS),
]
Env = Annotated[
    dict[
        Annotated[str, StringConstraints(min_length=1, pattern=r"^[^=\x00]+$")],
        Annotated[str, StringConstraints(pattern=r"^[^\x00]*$")],
    ],
    Field(max_length=MAX_ENV_VARS),
    _max_bytes(MAX_ENV_BYTES, "the environment", _env_bytes),
]
RetentionDays = Annotated[int, Field(ge=1, le=MAX_RETENTION_DAYS)]
#: where in the guest a volume or drive is mounted (normalized; no system directory)
MountPath = Annotated[str, AfterValidator(check_mount_path)]
#: the longest timeout a call takes (a year; longer: None, no limit)
MAX_TIMEOUT = 365 * 86400.0
#: seconds a call may run; None: no limit
Timeout = Annotated[float | None, Field(gt=0, le=MAX_TIMEOUT)]


def _takes_none(field: Any) -> bool:
    """Whether None is a value of its own for ``field``: it may be None and defaults to
    something else (a command's ``timeout=None``: no limit, not the default 60 s)."""
    ann = field.annotation
    nullable = get_origin(ann) in (Union, types.UnionType) and type(None) in get_args(ann)
    return nullable and field.default is not None


# -- requests --------------------------------------------------------------------------------

S = TypeVar("S", bound="Spec")


class Spec(BaseModel):
    """The base of every request: unknown fields refused, None as "not given" (see above)."""

    model_config = ConfigDict(extra="forbid")

    #: the field a bare string stands for in :meth:`of` (``"echo hi"``: ``cmd="echo hi"``)
    _positional: ClassVar[str | None] = None

    @model_validator(mode="before")
    @classmethod
    def _none_is_not_given(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or _takes_none(fields[k])
        }

    @classmethod
    def of(cls, base: BaseModel | str | None = None, /, **fields: Any) -> Self:
        """A ``cls`` made of ``base`` (a request, or a string for :attr:`_positional`) and
        ``fields`` (which win). ``base`` itself when it is a ``cls`` and nothing is added.

        Raises InvalidArgument (every bad field), InvalidName, PayloadTooLarge.
        """
        if isinstance(base, str):
            if cls._positional is None:
                raise TypeError(f"{cls.__name__} takes no positional string")
            fields = {cls._positional: base, **fields}
        elif base is not None:
            if type(base) is cls and not fields:
                return base
            fields = {**base.model_dump(exclude_unset=True), **fields}
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            raise invalid_argument(exc.errors(), f"invalid {_words(cls.__name__)}") from None

    def given(self) -> dict[str, Any]:
        """The fields the caller set, as the SDK sends them."""
        return self.model_dump(mode="json", exclude_unset=True)

    def narrow(self, model: type[S]) -> S:
        """The fields of ``model`` that this request sets, as a ``model`` (the others are
        dropped: the options part of a :class:`SandboxSpec`)."""
        return model.of(**self.model_dump(include=set(model.model_fields), exclude_unset=True))


class RestoreSpec(Spec):
    """What a new sandbox from a stored snapshot may choose (its machine is the snapshot's)."""

    name: SandboxName | None = Field(default=None, description="default: the sandbox's id")
    labels: Labels | None = None
    idle_pause_seconds: int | None = Field(
        default=None,
        ge=1,
        le=MAX_IDLE_PAUSE_SECONDS,
        description="hibernate after that long without a call; None: never",
    )
    pause_retention_days: RetentionDays = Field(
        default=30, description="kill the sandbox once it has been paused that long"
    )
    envs: Env | None = Field(
        default=None,
        description="environment variables of every command and of the interpreter (kept "
        "secret: never in the sandbox's info)",
    )


ScopeName = Annotated[
    str, AfterValidator(lambda v: check_name(v, "memory scope name")), _NAME_SCHEMA
]


#: the levels of a memory scope path, outermost first (torpor.memory.models.SCOPE_LEVELS)
SCOPE_LEVELS = ("app", "user", "agent", "session")
#: the most grants a memory binding may carry (as many as a token may)
MAX_SCOPE_GRANTS = 100


def check_scope_prefix(prefix: object) -> str:
    """``prefix`` if it is a memory scope path in its one spelling (``""``: the whole tenant;
    ``"app/a/user/u"``: level/name pairs in the levels' order). Raises InvalidArgument."""
    if not isinstance(prefix, str):
        raise InvalidArgument(f"a grant's prefix is a scope path, not {prefix!r}", field="prefix")
    parts = prefix.split("/") if prefix else []
    levels = parts[0::2]
    if (
        len(parts) % 2
        or any(lv not in SCOPE_LEVELS for lv in levels)
        or [SCOPE_LEVELS.index(lv) for lv in levels]
        != sorted({SCOPE_LEVELS.index(lv) for lv in levels})
    ):
        raise InvalidArgument(
            f"{prefix!r} is not a scope path such as 'app/a/user/u'", field="prefix", value=prefix
        )
    for name in parts[1::2]:
        check_name(name, "memory scope name")
    return prefix


class ScopeGrant(Spec):
    """A right of a memory binding: ``read`` or ``write`` (write implies read) on every scope
    under ``prefix`` (a scope path; ``""``: the whole tenant)."""

    mode: Literal["read", "write"]
    prefix: Annotated[str, AfterValidator(check_scope_prefix)]


class MemoryScope(Spec):
    """The memory a sandbox's agent reaches from inside, at ``localhost:7777`` with no
    credential: this scope of the sandbox's tenant (and the scopes below it, and what recall
    reads above it)."""

    app: ScopeName | None = None
    user: ScopeName | None = None
    agent: ScopeName | None = None
    session: ScopeName | None = None
    read_only: bool = Field(default=False, description="recall only: no remember or forget")
    grants: list[ScopeGrant] | None = Field(
        default=None,
        max_length=MAX_SCOPE_GRANTS,
        description="the rights the guest's calls are limited to, as a token's grants; None: "
        "the tenant's (the server sets a restricted token's own grants here, so its guest "
        "never reads more than the token could)",
    )

    def levels(self) -> dict[str, str]:
        """The scope's levels that are set (``{"app": "a", "user": "u"}``)."""
        return {lv: v for lv in SCOPE_LEVELS if (v := getattr(self, lv)) is not None}

    def record(self) -> dict[str, Any]:
        """What the registry keeps: the levels set, ``read_only`` when true, ``grants`` when
        given."""
        return self.model_dump(exclude_none=True, exclude_defaults=True)


class SandboxOptions(RestoreSpec):
    """A new sandbox forked from a template's booted snapshot (create, get-or-create)."""

    template: TemplateName = "python"
    vcpus: int = Field(default=1, ge=1, le=MAX_VCPUS)
    memory_mib: int = Field(default=512, ge=MIN_MEMORY_MIB, le=MAX_MEMORY_MIB)
    memory_scope: MemoryScope | None = Field(
        default=None, description="the memory its agent reaches at localhost:7777; None: none"
    )
    internet: bool | None = Field(
        default=None,
        description="a network card to reach the internet (QEMU user-mode NAT); None: on "
        "when the host allows it (TORPOR_ALLOW_INTERNET=1), else off",
    )

    def named(self, name: str) -> SandboxOptions:
        """These options for the sandbox called ``name`` (get-or-create's path). Raises
        InvalidArgument when they name another one."""
        if self.name is not None and self.name != name:
            raise InvalidArgument(
                f"the options name {self.name!r}, not {name!r}", name=name, field="name"
            )
        return SandboxOptions.of(self, name=name)


class SandboxSettings(Spec):
    """What may change on a live sandbox (``sbx.set``, ``PATCH /v1/sandboxes/{id}``); a field
    left out stays as it is."""

    labels: Labels | None = Field(default=None, description="the new labels (replace all)")
    idle_pause_seconds: int | None = Field(
        default=None,
        ge=0,
        le=MAX_IDLE_PAUSE_SECONDS,
        description="hibernate after that long without a call; 0: never",
    )


class _Mount(Spec):
    path: MountPath
    read_only: bool = False


class VolumeMount(_Mount):
    """A volume (id or name) mounted at ``path``: read-write in one sandbox, read-only in many."""

    volume: str = Field(min_length=1)


class DriveMount(_Mount):
    """A drive (id or name) mounted at ``path`` (many writers at once)."""

    drive: str = Field(min_length=1)


class SandboxSpec(SandboxOptions):
    """Everything a create takes: a template fork or, with ``snapshot``, a restore (whose
    template and sizes are the snapshot's), with volumes and drives mounted."""

    snapshot: str | None = Field(default=None, min_length=1, description="snapshot id or name")
    volumes: list[VolumeMount] = Field(default_factory=list, max_length=MAX_MOUNTS)
    drives: list[DriveMount] = Field(default_factory=list, max_length=MAX_MOUNTS)

    @model_validator(mode="after")
    def _slots(self) -> Self:
        if len(self.volumes) + len(self.drives) > MAX_MOUNTS:
            raise ValueError(f"at most {MAX_MOUNTS} volumes and drives together")
        if self.snapshot is not None and self.internet is not None:
            raise ValueError("a restore keeps its snapshot's network: give no internet with it")
        return self

    @property
    def plain(self) -> bool:
        """Whether a template fork is all that is asked (no snapshot, volumes or drives): what
        :meth:`SandboxManager.create` makes alone."""
        return self.snapshot is None and not self.volumes and not self.drives


class CommandSpec(Spec):
    """A shell command, run with ``/bin/sh -c``."""

    _positional = "cmd"

    cmd: Annotated[str, Field(min_length=1), _max_bytes(MAX_ARG_BYTES, "the command", _utf8)]
    cwd: str | None = Field(default=None, max_length=MAX_PATH)
    env: Env | None = None
    timeout: Timeout = Field(default=COMMAND_TIMEOUT, description="seconds; None: no limit")
    background: bool = Field(default=False, description="answer at once with the pid")


class PtySize(Spec):
    """A terminal's window size, in characters."""

    cols: int = Field(default=80, ge=1, le=1000)
    rows: int = Field(default=24, ge=1, le=1000)


class PtySpec(PtySize):
    """A program on a terminal of its own (``sbx.pty.create``, ``torpor sandbox shell``)."""

    _positional = "cmd"

    cmd: Annotated[str, Field(min_length=1), _max_bytes(MAX_ARG_BYTES, "the command", _utf8)] = (
        "bash"
    )
    cwd: str | None = Field(default=None, max_length=MAX_PATH)
    env: Env | None = Field(default=None, description="over the sandbox's envs; TERM too")


class CodeSpec(Spec):
    """Python code for the sandbox's long-lived interpreter."""

    _positional = "code"

    code: Annotated[str, _unicode("code"), _max_bytes(LIMITS.max_code_bytes, "code", _utf8)]
    timeout: Timeout = None


class SnapshotSpec(Spec):
    """A snapshot of a sandbox (RAM + disk)."""

    name: SnapshotName | None = Field(default=None, description="default: <sandbox>-<time>")
    retention_days: RetentionDays = 7
    labels: Labels | None = None
    wait: bool = Field(
        default=False,
        description="return once the snapshot is in the chunk store (status 'stored'); by "
        "default it returns once frozen (status 'capturing': restore and fork work at once)",
    )


class ForkSpec(Spec):
    """``count`` new sandboxes from a sandbox or a snapshot."""

    count: int = Field(default=1, ge=1, le=LIMITS.max_fork_count)
    labels: Labels | None = None
    names: list[SandboxName] | None = Field(default=None, description="one per child")
    memory_scope: MemoryScope | None = Field(
        default=None, description="the children's memory scope; None: the source's"
    )
    envs: Env | None = Field(
        default=None,
        description="environment variables set over the source's (which the children keep)",
    )

    @model_validator(mode="after")
    def _one_name_each(self) -> Self:
        if self.names is not None and len(self.names) != self.count:
            raise ValueError(f"{len(self.names)} names for {self.count} children")
        return self


class VolumeSpec(Spec):
    """A new empty (ext4) volume."""

    _positional = "name"

    name: VolumeName
    size_mib: int = Field(default=1024, ge=MIN_VOLUME_MIB, le=MAX_VOLUME_MIB)
    labels: Labels | None = Field(
        default=None,
        description="e.g. {'user': 'u-42'}: lists filter by them, tokens reach by them",
    )


class DriveSpec(Spec):
    """A new empty drive."""

    _positional = "name"

    name: DriveName
    labels: Labels | None = Field(
        default=None,
        description="e.g. {'user': 'u-42'}: lists filter by them, tokens reach by them",
    )


class GcSpec(Spec):
    """A retention + garbage collection pass."""

    dry_run: bool = Field(default=False, description="report what would go, remove nothing")
