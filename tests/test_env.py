"""The runtime environment every engine start applies (edge_core/runtime_env.py). No vLLM needed."""

from __future__ import annotations

import pytest

from edge_core.runtime.env import (
    ALREADY,
    ENGINE_MARK,
    KEPT,
    RULES,
    SET,
    UNSET,
    EnvRule,
    apply_runtime_env,
    runtime_rules,
)


def test_kv_space_override_is_removed_and_reported():
    env = {"VLLM_CPU_KVCACHE_SPACE": "40"}
    applied = apply_runtime_env(env)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    change = next(c for c in applied.changes if c.name == "VLLM_CPU_KVCACHE_SPACE")
    assert (change.action, change.previous, change.value) == (UNSET, "40", None)
    assert "VLLM_CPU_KVCACHE_SPACE" in [c.name for c in applied.overridden]


def test_forced_rule_replaces_the_users_value_and_says_so():
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_STREAM": "ext://sys.stdout"}
    applied = apply_runtime_env(env, layout_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, layout_why="two ranks")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert env["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"
    assert {c.name for c in applied.overridden} == {"VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_STREAM"}
    change = next(c for c in applied.changes if c.name == "VLLM_ENABLE_V1_MULTIPROCESSING")
    assert "process layout" in change.why and "two ranks" in change.why


def test_the_process_layout_is_the_plans_and_no_rule_of_its_own():
    # VLLM_ENABLE_V1_MULTIPROCESSING was forced to 1 for every engine; now the plan's execution.env says it.
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in {rule.name for rule in RULES}
    env: dict[str, str] = {}
    apply_runtime_env(env, layout_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2"})
    assert (env["VLLM_ENABLE_V1_MULTIPROCESSING"], env["OMP_NUM_THREADS"]) == ("0", "2")


def test_edges_engine_carries_the_mark_and_plain_vllm_never_does():
    edge: dict[str, str] = {}
    apply_runtime_env(edge, edge_engine=True)
    assert edge[ENGINE_MARK] == "1"
    plain = {ENGINE_MARK: "1"}  # a user's shell, or edge's own stage before the reference run
    applied = apply_runtime_env(plain)  # plain vLLM unless a caller says otherwise
    assert ENGINE_MARK not in plain
    assert next(c for c in applied.changes if c.name == ENGINE_MARK).action == UNSET


def test_the_mark_is_the_variable_edge_cpus_plugins_read():
    edge_cpu = pytest.importorskip("edge_cpu._engine", reason="edge-cpu is not installed in this venv")
    assert edge_cpu.ENGINE_ENV == ENGINE_MARK


def test_default_rule_keeps_a_value_the_user_chose():
    env = {"VLLM_LOGGING_LEVEL": "INFO", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "0"}
    applied = apply_runtime_env(env)
    assert (env["VLLM_LOGGING_LEVEL"], env["VLLM_CPU_OMP_THREADS_BIND"], env["HF_HUB_OFFLINE"]) == ("INFO", "0-1", "0")
    kept = {c.name for c in applied.changes if c.action == KEPT}
    assert kept == {"VLLM_LOGGING_LEVEL", "VLLM_CPU_OMP_THREADS_BIND", "HF_HUB_OFFLINE"}
    assert not applied.overridden


def test_empty_environment_gets_every_value():
    env: dict[str, str] = {}
    applied = apply_runtime_env(env, edge_engine=True)
    rules = runtime_rules(edge_engine=True)
    wanted = {rule.name: rule.value for rule in rules if rule.value is not None}
    assert env == wanted
    assert applied.values == {rule.name: rule.value for rule in rules}
    assert all(c.action in (SET, ALREADY) for c in applied.changes)


def test_applying_twice_changes_nothing_the_second_time():
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "DEBUG"}
    apply_runtime_env(env)
    snapshot = dict(env)
    second = apply_runtime_env(env)
    assert env == snapshot
    assert all(c.action in (ALREADY, KEPT) for c in second.changes)


def test_every_rule_is_documented_once():
    names = [rule.name for rule in RULES]
    assert len(names) == len(set(names))
    for rule in RULES:
        assert len(rule.why) > 40, f"{rule.name} needs a why"
    assert {"VLLM_CPU_KVCACHE_SPACE", "VLLM_NO_USAGE_STATS", "VLLM_CPU_OMP_THREADS_BIND"} <= set(names)


def test_custom_rules_and_record_round_trip():
    rule = EnvRule("EDGE_TEST_ONLY", "x", False, "a rule that exists for this test only, nothing else reads it")
    env = {"EDGE_TEST_ONLY": "y"}
    applied = apply_runtime_env(env, rules=(rule,))
    doc = applied.to_dict()
    assert doc["values"] == {"EDGE_TEST_ONLY": "y"}
    assert doc["changes"][0]["action"] == KEPT and doc["overridden"] == []


def test_default_target_is_the_process_environment(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    for rule in RULES:
        if rule.name != "VLLM_CPU_KVCACHE_SPACE":
            monkeypatch.delenv(rule.name, raising=False)
    apply_runtime_env()
    import os

    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    assert os.environ["VLLM_NO_USAGE_STATS"] == "1"
