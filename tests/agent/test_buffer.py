"""The on-disk buffer: order, persistence across a restart, dead letters, commands."""

from __future__ import annotations

from pathlib import Path

from nodes.agent.buffer import Buffer


def test_heartbeats_are_numbered_and_kept_in_order_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "agent.sqlite3"
    with Buffer(path) as buffer:
        assert [buffer.add_heartbeat({"samples": [i]}) for i in range(3)] == [1, 2, 3]
        buffer.add_report("cmd-1", {"status": "accepted"})
        buffer.ack(buffer.peek().id)
    with Buffer(path) as buffer:
        assert buffer.add_heartbeat({"samples": [3]}) == 4  # seq continues after a restart
        items = buffer.pending()
        assert [(i.kind, i.key) for i in items] == [
            ("heartbeat", "2"),
            ("heartbeat", "3"),
            ("report", "cmd-1"),
            ("heartbeat", "4"),
        ]
        assert items[0].body == {"seq": 2, "samples": [1]}
        assert buffer.has_pending_report("cmd-1") and not buffer.has_pending_report("cmd-2")


def test_failures_are_counted_and_bad_items_dead_lettered(tmp_path: Path) -> None:
    with Buffer(tmp_path / "agent.sqlite3") as buffer:
        buffer.add_heartbeat({"samples": []})
        buffer.add_heartbeat({"samples": []})
        first = buffer.peek()
        buffer.note_failure(first.id, "ConnectError")
        buffer.note_failure(first.id, "503")
        assert buffer.peek().attempts == 2
        buffer.dead_letter(buffer.peek(), 400, "400 invalid: samples")
        assert buffer.peek().key == "2"
        assert buffer.count() == 1
        (dead,) = buffer.dead_letters()
        assert (dead["key"], dead["status_code"], dead["error"]) == ("1", 400, "400 invalid: samples")
        assert dead["body"] == {"seq": 1, "samples": []}


def test_renumbering_for_a_new_node_id(tmp_path: Path) -> None:
    with Buffer(tmp_path / "agent.sqlite3") as buffer:
        for _ in range(5):
            buffer.add_heartbeat({})
        buffer.ack(buffer.peek().id)
        buffer.ack(buffer.peek().id)
        buffer.renumber_heartbeats()
        assert [i.body["seq"] for i in buffer.pending()] == [1, 2, 3]
        assert buffer.add_heartbeat({}) == 4


def test_commands_remember_their_outcome(tmp_path: Path) -> None:
    path = tmp_path / "agent.sqlite3"
    with Buffer(path) as buffer:
        buffer.command_accepted("c1", "drain", {}, {"status": "accepted"})
        assert buffer.command("c1").state == "accepted" and not buffer.command("c1").finished
        assert [c.id for c in buffer.unfinished_commands()] == ["c1"]
        buffer.command_finished("c1", "succeeded", {"draining": True}, "", {"status": "succeeded"})
    with Buffer(path) as buffer:
        record = buffer.command("c1")
        assert (record.state, record.result, record.finished) == ("succeeded", {"draining": True}, True)
        assert buffer.command("c2") is None
        assert [i.body["status"] for i in buffer.pending()] == ["accepted", "succeeded"]
        assert buffer.unfinished_commands() == []


def test_only_the_removal_of_a_sent_item_skips_the_disk_sync(tmp_path: Path) -> None:
    """Queueing is synced to disk (synchronous=FULL); removing an item the portal took is not, and
    the connection is back to FULL after it, for the next item queued."""
    synced = []
    with Buffer(tmp_path / "state.db") as buffer:
        buffer.db.set_trace_callback(lambda sql: synced.append(sql) if "synchronous" in sql else None)
        buffer.add_heartbeat({"samples": []})
        item = buffer.peek()
        buffer.ack(item.id)
        assert buffer.peek() is None
        assert synced == ["PRAGMA synchronous=NORMAL", "PRAGMA synchronous=FULL"]
        assert buffer.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_an_idle_agent_skips_the_database_until_output_is_queued(tmp_path: Path) -> None:
    """Once a look finds no workload output waiting, ``log_batch`` answers None without a query
    until lines are queued; a buffer opened again looks first (lines kept from before a restart)."""
    statements: list[str] = []
    with Buffer(tmp_path / "state.db") as buffer:
        assert buffer.log_batch(10) is None  # looked: nothing waits
        buffer.db.set_trace_callback(statements.append)
        assert buffer.log_batch(10) is None
        assert statements == []
        buffer.log_add("7", [], "logcursor:7", '{"offset": 1}')  # a cursor moved, no line
        statements.clear()
        assert buffer.log_batch(10) is None and statements == []
        buffer.log_add("7", [(1.0, "stdout", "a")], "logcursor:7", '{"offset": 2}')
        seq, body = buffer.log_batch(10)
        assert '"a"' in body
        buffer.log_ack(seq)
        assert buffer.log_batch(10) is None  # looked again, then quiet
        buffer.log_add("7", [(2.0, "stdout", "b")], "logcursor:7", '{"offset": 3}')
    with Buffer(tmp_path / "state.db") as reopened:
        seq, body = reopened.log_batch(10)
        assert '"b"' in body
