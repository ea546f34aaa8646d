"""Registering batches as partitions while another launcher registers some of the same ones."""

import dagster as dg
import pytest

from filter_pipeline.cli.materialize import REGISTER_TRIES, _register


class AnotherLauncherWins:
    """The instance, where another launcher wins our next inserts, one per round: it registers that round's
    keys after the storage looked for existing keys and before it inserts ours, so the storage refuses our
    whole batch, as SQLite's UNIQUE constraint did when two CLI processes started together."""

    def __init__(self, instance: dg.DagsterInstance, *rounds: list[str]):
        self.instance, self.rounds = instance, list(rounds)

    def add_dynamic_partitions(self, name: str, keys: list[str]) -> None:
        if self.rounds:
            self.instance.add_dynamic_partitions(name, self.rounds.pop(0))
            raise RuntimeError("UNIQUE constraint failed: dynamic_partitions.partitions_def_name, partition")
        self.instance.add_dynamic_partitions(name, keys)

    def __getattr__(self, name):
        return getattr(self.instance, name)


def registered(instance) -> list[str]:
    return sorted(instance.get_dynamic_partitions("run_id"))


def test_a_batch_of_keys_refused_for_one_registered_meanwhile_is_registered_still():
    with dg.DagsterInstance.ephemeral() as instance:
        _register(AnotherLauncherWins(instance, ["b1"]), ["b1", "b2"])
        assert registered(instance) == ["b1", "b2"]


def test_losing_several_races_in_a_row_still_registers_every_key():
    with dg.DagsterInstance.ephemeral() as instance:
        _register(AnotherLauncherWins(instance, ["b1"], ["b2"]), ["b1", "b2", "b3"])
        assert registered(instance) == ["b1", "b2", "b3"]


def test_an_insert_that_keeps_failing_fails_after_the_last_try():
    with dg.DagsterInstance.ephemeral() as instance:
        endless = AnotherLauncherWins(instance, *[[f"x{i}"] for i in range(REGISTER_TRIES)])
        with pytest.raises(RuntimeError, match="UNIQUE"):
            _register(endless, ["b1"])
        assert "b1" not in registered(instance)
