"""`flydsl demo` reports each case as it finishes, not one table at the end.

The interpreter takes seconds a case, so a silent run looked hung for a minute.
"""

from __future__ import annotations

import torch

from flydsl import cli
from flydsl.families import DemoCase, DemoRun, Family


def test_demo_prints_each_row_when_its_case_finishes(monkeypatch, capsys):
    seen_before = {}

    def prepare(device):
        x = torch.arange(4.0, device=device)
        return DemoRun(ours=lambda: x * 2, reference=lambda: x.double() * 2, torch_op=lambda: x * 2,
                       torch_name="mul", tolerance=1e-6)

    def prepare_second(device):
        # What the user has seen by the time the second case starts running.
        seen_before["second"] = capsys.readouterr().out
        return prepare(device)

    fam = Family(name="fake", distribution="fly-fake", module="fake_mod", version="9.9",
                 demo_cases=lambda: [DemoCase("first case", prepare), DemoCase("second case", prepare_second)])
    monkeypatch.setattr(cli, "discover", lambda: {"fake": fam})
    assert cli.main(["demo", "--no-time"]) == 0
    shown = seen_before["second"]
    assert "2 demo cases from fake" in shown  # announced before anything runs
    rows = [ln for ln in shown.splitlines() if ln.startswith("fake")]
    assert len(rows) == 2, shown
    assert "first case" in rows[0] and " yes " in rows[0] and rows[0].rstrip().endswith("mul")  # finished row
    assert "second case" in rows[1] and " yes " not in rows[1]  # the running case, named, not yet judged
    rest = capsys.readouterr().out
    assert " yes " in rest and "2 passed, 0 failed" in rest


def test_run_demo_callbacks_in_order():
    events = []

    def prepare(device):
        x = torch.ones(3, device=device)
        return DemoRun(ours=lambda: x, reference=lambda: x.double(), torch_op=lambda: x, torch_name="id",
                       tolerance=1e-6)

    fam = Family(name="fake", distribution="fly-fake", module="fake_mod", version="9.9",
                 demo_cases=lambda: [DemoCase("a", prepare), DemoCase("b", prepare)])
    results = cli.run_demo([fam], time_it=False, on_start=lambda f, c: events.append(("start", c)),
                           on_result=lambda r, s: events.append(("done", r.name, s >= 0)))
    assert events == [("start", "a"), ("done", "a", True), ("start", "b"), ("done", "b", True)]
    assert [r.name for r in results] == ["a", "b"] and all(r.ok for r in results)
