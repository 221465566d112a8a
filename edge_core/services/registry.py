"""Which backends are installed in this interpreter, which of them work, and who owns a device.

Backends register in the ``edge.backends`` entry-point group. Each one is
loaded and probed in isolation: an import error, a hook that raises, a probe
that hangs or a wrong return type becomes a *status* with a reason on that
plugin, while the others keep working. Nothing is ever silently dropped or
silently replaced by another device.

Order is deterministic: by priority (a plugin's ``EDGE_PRIORITY``, overridable
by the user), then by name.
"""

from __future__ import annotations

import importlib.metadata as metadata
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from .. import hookspecs
from .._version import __version__
from ..devices import Device, apply_mask
from ..host import HostFacts, read_host

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "edge.backends"

#: Comma-separated plugin names: only these are imported (the ``--plugins`` flag wins).
ALLOW_ENV = "EDGE_PLUGINS"
#: Comma-separated plugin names that are never imported (the ``--block`` flag adds to it).
BLOCK_ENV = "EDGE_BLOCK_PLUGINS"
#: ``name=priority`` pairs overriding a plugin's declared priority (lower goes first).
PRIORITY_ENV = "EDGE_PLUGIN_PRIORITY"
#: Set to 1 to print every hook call, its arguments and its result to stderr.
TRACE_ENV = "EDGE_TRACE_HOOKS"
#: Seconds before a silent probe is reported as timed out (default PROBE_TIMEOUT_S).
PROBE_TIMEOUT_ENV = "EDGE_PROBE_TIMEOUT_S"

#: A probe that has not answered after this many seconds is reported as timed
#: out and the others still answer. Real probes take milliseconds (the slowest
#: step seen, NVML init, ~50 ms); 5 s only catches hangs.
PROBE_TIMEOUT_S = 5.0
#: The name of each probe's thread begins so (its plugin's name follows).
PROBE_THREAD_PREFIX = "edge-probe-"

#: Priority of a plugin that declares none.
DEFAULT_PRIORITY = 100

# Plugin statuses.
LOADED = "loaded"
NO_DEVICES = "no_devices"
BLOCKED = "blocked"
NOT_ALLOWED = "not_allowed"
IMPORT_ERROR = "import_error"
API_MISMATCH = "api_mismatch"
INVALID = "invalid"
PROBE_ERROR = "probe_error"
PROBE_TIMEOUT = "probe_timeout"

#: Statuses that mean the plugin works (possibly with nothing to drive here).
HEALTHY = (LOADED, NO_DEVICES)
#: Statuses that mean the user chose not to load it.
SKIPPED = (BLOCKED, NOT_ALLOWED)


@dataclass
class PluginRecord:
    """What edge knows about one discovered plugin. Mutable while loading; frozen in output."""

    name: str
    distribution: str | None = None
    version: str | None = None
    module: str | None = None
    status: str = LOADED
    reason: str | None = None
    hooks: tuple[str, ...] = ()
    api_version: Any = None
    priority: int = DEFAULT_PRIORITY
    load_time_s: float = 0.0
    probe_time_s: float | None = None
    device_ids: tuple[str, ...] = ()
    plugin: Any = field(default=None, repr=False)

    @property
    def healthy(self) -> bool:
        return self.status in HEALTHY

    @property
    def skipped(self) -> bool:
        """The user chose not to load it (blocked, or not in an allow-list)."""
        return self.status in SKIPPED

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module,
            "status": self.status,
            "reason": self.reason,
            "hooks": list(self.hooks),
            "api_version": self.api_version,
            "priority": self.priority,
            "load_time_s": round(self.load_time_s, 6),
            "probe_time_s": None if self.probe_time_s is None else round(self.probe_time_s, 6),
            "device_ids": list(self.device_ids),
        }


def _split(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _parse_priorities(text: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for pair in _split(text):
        name, sep, value = pair.partition("=")
        try:
            out[name.strip()] = int(value)
        except ValueError:
            log.warning("ignoring %s entry %r: expected name=integer", PRIORITY_ENV, pair)
            continue
        if not sep:
            log.warning("ignoring %s entry %r: expected name=integer", PRIORITY_ENV, pair)
    return out


class Registry:
    """Discovers, loads, probes and dispatches to backends.

    ``entry_points`` may be injected (tests); by default it is read from the
    installed distributions' metadata. ``allow``/``block`` name plugins by their
    entry-point name and apply *before* anything is imported.
    """

    def __init__(
        self,
        entry_points: Iterable[Any] | None = None,
        *,
        allow: Iterable[str] | None = None,
        block: Iterable[str] | None = None,
        priorities: Mapping[str, int] | None = None,
        probe_timeout_s: float | None = None,
        trace: bool | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self._entry_points = entry_points
        self.allow = list(allow) if allow is not None else _split(env.get(ALLOW_ENV)) or None
        self.block = set(_split(env.get(BLOCK_ENV))) | set(block or ())
        self.priorities = {**_parse_priorities(env.get(PRIORITY_ENV)), **dict(priorities or {})}
        if probe_timeout_s is None:
            try:
                probe_timeout_s = float(env.get(PROBE_TIMEOUT_ENV) or PROBE_TIMEOUT_S)
            except ValueError:
                log.warning("ignoring %s=%r: not a number", PROBE_TIMEOUT_ENV, env.get(PROBE_TIMEOUT_ENV))
                probe_timeout_s = PROBE_TIMEOUT_S
        self.probe_timeout_s = probe_timeout_s
        self.records: dict[str, PluginRecord] = {}
        #: Problems that are not one plugin's status (unknown names in lists, id conflicts).
        self.warnings: list[str] = []
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        if trace if trace is not None else env.get(TRACE_ENV, "") not in ("", "0"):
            self._enable_tracing()
        self._loaded = False

    # -- discovery and loading -------------------------------------------------

    def _discover(self) -> list[Any]:
        if self._entry_points is not None:
            return list(self._entry_points)
        return list(metadata.entry_points(group=ENTRY_POINT_GROUP))

    def load(self) -> list[PluginRecord]:
        """Import every allowed plugin and register its hooks. Never raises for a plugin's fault."""
        if self._loaded:
            return self.plugins()
        self._loaded = True
        found = self._discover()
        names = {ep.name for ep in found}
        for wanted in self.allow or ():
            if wanted not in names:
                self.warnings.append(
                    f"plugin {wanted!r} is named in the allow-list but is not installed in this "
                    f"interpreter ({sys.executable}); installed: {', '.join(sorted(names)) or 'none'}"
                )
        for unknown in sorted(self.block - names):
            self.warnings.append(f"plugin {unknown!r} is named in the block-list but is not installed")
        for ep in found:
            if ep.name in self.records:
                self.warnings.append(
                    f"two installed distributions register a backend named {ep.name!r}; "
                    f"only the first ({self.records[ep.name].distribution}) is used"
                )
                continue
            self.records[ep.name] = self._load_one(ep)
        return self.plugins()

    def _load_one(self, ep: Any) -> PluginRecord:
        dist = getattr(ep, "dist", None)
        # Each of a distribution's ``name`` and ``version`` parses its METADATA file again (~1 ms); read it once.
        about = getattr(dist, "metadata", None) or {}
        record = PluginRecord(
            name=ep.name,
            distribution=about.get("Name"),
            version=about.get("Version"),
            module=getattr(ep, "value", None),
        )
        if ep.name in self.block:
            record.status, record.reason = BLOCKED, "blocked by the block-list; not imported"
            return record
        if self.allow is not None and ep.name not in self.allow:
            record.status, record.reason = NOT_ALLOWED, "not in the allow-list; not imported"
            return record
        started = time.perf_counter()
        try:
            plugin = ep.load()
        except BaseException as exc:  # noqa: BLE001 - a plugin's import may raise anything, even SystemExit
            record.load_time_s = time.perf_counter() - started
            record.status = IMPORT_ERROR
            record.reason = f"importing {record.module} failed: {type(exc).__name__}: {exc}"
            return record
        record.load_time_s = time.perf_counter() - started
        self._register(record, plugin)
        return record

    def register(self, plugin: Any, name: str, *, distribution: str | None = None) -> PluginRecord:
        """Register an already imported plugin object (tests, embedding applications)."""
        record = PluginRecord(name=name, distribution=distribution, module=getattr(plugin, "__name__", None))
        self.records[name] = record
        self._loaded = True
        self._register(record, plugin)
        return record

    def unregister(self, name: str) -> None:
        record = self.records.pop(name, None)
        if record is not None and record.plugin is not None and self.pm.is_registered(record.plugin):
            self.pm.unregister(record.plugin)

    def _register(self, record: PluginRecord, plugin: Any) -> None:
        declared = getattr(plugin, "EDGE_API_VERSION", None)
        record.api_version = declared
        record.priority = self.priorities.get(
            record.name, getattr(plugin, "EDGE_PRIORITY", DEFAULT_PRIORITY)
        )
        if declared != hookspecs.API_VERSION:
            record.status = API_MISMATCH
            what = "declares no EDGE_API_VERSION" if declared is None else f"implements edge API {declared!r}"
            record.reason = (
                f"plugin {record.name!r} ({record.distribution or record.module}) {what}, but "
                f"edge-core {__version__} implements API {hookspecs.API_VERSION}; install a "
                f"version of {record.distribution or record.name} built for this edge-core, or an "
                f"edge-core that matches the plugin"
            )
            return
        try:
            self.pm.register(plugin, name=record.name)
        except Exception as exc:  # pluggy.PluginValidationError and friends
            record.status, record.reason = INVALID, f"hook validation failed: {exc}"
            return
        callers = self.pm.get_hookcallers(plugin) or []
        unknown = sorted(caller.name for caller in callers if caller.spec is None)
        if unknown:
            # pluggy accepts hooks it has no spec for (a typo is silently never called).
            self.pm.unregister(plugin)
            record.status = INVALID
            record.reason = (
                f"implements {', '.join(unknown)}, which edge API {hookspecs.API_VERSION} does not "
                f"define; hooks are {', '.join(hookspecs.BROADCAST_HOOKS + hookspecs.OWNER_HOOKS)}"
            )
            return
        record.plugin = plugin
        record.hooks = tuple(sorted(caller.name for caller in callers))

    # -- probing ---------------------------------------------------------------

    def plugins(self) -> list[PluginRecord]:
        """Every discovered plugin, in dispatch order."""
        return sorted(self.records.values(), key=lambda r: (r.priority, r.name))

    def install_hint(self) -> str:
        """What to tell a user whose interpreter (this registry's) has no backend at all."""
        return install_hint()

    def loaded(self) -> list[PluginRecord]:
        return [r for r in self.plugins() if r.plugin is not None and r.status not in (API_MISMATCH, INVALID)]

    def probe(self, host: HostFacts) -> list[Device]:
        """Ask every loaded plugin for its devices, concurrently, each under the probe time limit."""
        self.load()
        runs: list[tuple[PluginRecord, threading.Thread, dict[str, Any]]] = []
        for record in self.loaded():
            if "probe_devices" not in record.hooks:
                record.status, record.reason = NO_DEVICES, "implements no probe_devices hook"
                continue
            box: dict[str, Any] = {}
            caller = self._caller_for(record, "probe_devices")
            thread = threading.Thread(
                target=_call_into, args=(caller, {"host": host}, box),
                name=f"{PROBE_THREAD_PREFIX}{record.name}", daemon=True,
            )
            box["started"] = time.perf_counter()
            thread.start()
            runs.append((record, thread, box))
        deadline = time.monotonic() + self.probe_timeout_s
        devices: list[Device] = []
        owners: dict[str, str] = {}
        for record, thread, box in runs:
            thread.join(max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                record.status = PROBE_TIMEOUT
                record.reason = (
                    f"probe_devices did not answer within {self.probe_timeout_s:g} s; its devices "
                    f"are not listed (set {BLOCK_ENV}={record.name} to skip it)"
                )
                record.probe_time_s = self.probe_timeout_s
                continue
            record.probe_time_s = box.get("finished", box["started"]) - box["started"]
            if "error" in box:
                exc = box["error"]
                record.status = PROBE_ERROR
                record.reason = f"probe_devices raised {type(exc).__name__}: {exc}"
                continue
            found = self._validate_devices(record, box.get("result"))
            if found is None:
                continue
            kept = []
            for device in found:
                if device.device_id in owners:
                    self.warnings.append(
                        f"device {device.device_id!r} is claimed by plugins {owners[device.device_id]!r} "
                        f"and {record.name!r}; listing {owners[device.device_id]!r}'s record only "
                        f"(set {BLOCK_ENV} or {PRIORITY_ENV} to choose)"
                    )
                    continue
                owners[device.device_id] = record.name
                kept.append(device.replace(plugin=record.name))
            record.device_ids = tuple(d.device_id for d in kept)
            if not kept and record.status == LOADED:
                note = getattr(record.plugin, "last_probe_note", None)
                record.status = NO_DEVICES
                record.reason = note or "the probe found no device this backend drives"
            devices.extend(kept)
        return devices

    def _validate_devices(self, record: PluginRecord, result: Any) -> list[Device] | None:
        # firstresult is off for probe_devices: the caller returns a list of each plugin's answers.
        answers = result if isinstance(result, list) else [result]
        if not answers:
            return []
        answer = answers[0]
        if answer is None:
            return []
        if not isinstance(answer, (list, tuple)):
            record.status = INVALID
            record.reason = f"probe_devices returned {type(answer).__name__}, expected a list of edge_core.Device"
            return None
        bad = [type(item).__name__ for item in answer if not isinstance(item, Device)]
        if bad:
            record.status = INVALID
            record.reason = (
                f"probe_devices returned a list holding {', '.join(sorted(set(bad)))}; "
                f"every item must be an edge_core.Device"
            )
            return None
        return list(answer)

    # -- dispatch to the owning backend ----------------------------------------

    def _caller_for(self, record: PluginRecord, hook: str) -> Any:
        others = [r.plugin for r in self.records.values() if r.plugin is not None and r is not record
                  and self.pm.is_registered(r.plugin)]
        return self.pm.subset_hook_caller(hook, remove_plugins=others)

    def owner(self, device: Device) -> PluginRecord | None:
        """The loaded plugin that reported ``device``, or None (e.g. a device list from elsewhere)."""
        record = self.records.get(device.plugin or "")
        if record is None or record.plugin is None or not record.healthy:
            return None
        return record

    def call_owner(self, device: Device, hook: str, **kwargs: Any) -> Any:
        """Call ``hook`` on the plugin that owns ``device`` only; None if it has no such hook.

        Exceptions from the plugin propagate wrapped in :class:`PluginError`
        naming the plugin and hook, except :class:`EngineDied`: the engine the
        backend started died, and the error already names the process and why.
        """
        from ..errors import EngineDied, PluginError

        if hook not in hookspecs.OWNER_HOOKS:
            raise ValueError(f"{hook!r} is not an owner-dispatched hook")
        record = self.owner(device)
        if record is None or hook not in record.hooks:
            return None
        caller = self._caller_for(record, hook)
        try:
            return caller(device=device, **kwargs) if "device" in _argnames(caller) else caller(**kwargs)
        except EngineDied:
            raise
        except Exception as exc:
            raise PluginError(
                f"plugin {record.name!r} failed in {hook} for device {device.device_id!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    # -- tracing ---------------------------------------------------------------

    def _enable_tracing(self) -> None:
        def before(hook_name: str, hook_impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
            names = ", ".join(impl.plugin_name for impl in hook_impls)
            args = ", ".join(f"{k}={_short(v)}" for k, v in kwargs.items())
            print(f"edge trace: {hook_name}({args}) -> [{names}]", file=sys.stderr)

        def after(outcome: Any, hook_name: str, hook_impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
            exc = outcome.exception
            shown = f"raised {type(exc).__name__}: {exc}" if exc else _short(outcome.get_result())
            print(f"edge trace: {hook_name} <- {shown}", file=sys.stderr)

        self.pm.add_hookcall_monitoring(before, after)


def _argnames(caller: Any) -> tuple[str, ...]:
    spec = getattr(caller, "spec", None)
    return tuple(spec.argnames) if spec is not None else ()


def _call_into(caller: Any, kwargs: dict[str, Any], box: dict[str, Any]) -> None:
    try:
        box["result"] = caller(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported as the plugin's status
        box["error"] = exc
    finally:
        box["finished"] = time.perf_counter()


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."




def install_hint() -> str:
    """What to tell a user whose interpreter has no backend at all."""
    return (
        "no edge backend is installed in this interpreter "
        f"({sys.executable}). Install the one for this machine's hardware, e.g. "
        "`pip install edge-cpu` (vLLM CPU build) or `pip install edge-cuda` (NVIDIA GPUs), "
        "each in its own virtual environment"
    )



def discover(registry: Registry, mask: frozenset[str] = frozenset()) -> tuple[HostFacts, list[Device]]:
    """This host's facts and every device ``registry``'s backends see here, masked kinds marked."""
    host = read_host()
    return host, apply_mask(registry.probe(host), mask)
