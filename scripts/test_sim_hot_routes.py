"""Runs scripts/sim-hot-routes --check's hand-computable cases as a unit test:
python3 -m unittest discover -s scripts -p 'test_sim_hot_routes.py'"""

import importlib.machinery
import importlib.util
import os
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def load():
    path = os.path.join(HERE, "sim-hot-routes")
    loader = importlib.machinery.SourceFileLoader("sim_hot_routes", path)
    spec = importlib.util.spec_from_loader("sim_hot_routes", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class SimHotRoutes(unittest.TestCase):
    def test_check_cases(self):
        self.assertEqual(load().check(), [])

    def test_each_sub_log_is_a_batch_lane(self):
        # Ten requests at once at one instance: one log's lane sends the first alone and the
        # other nine in its next call; three sub-logs' lanes each do the same with their share
        # (4, 3, 3), so the same requests make three times the calls and pay the call's own part
        # three times as often.
        sim = load()
        a = sim.parse(["--instances", "1", "--masters", "1", "--sublogs", "3", "--route", "fused",
                       "--rtt-us", "100"])
        burst = [(0.0, 0)] * 10
        one, three = sim.sim_single(a, burst), sim.sim_sublogs(a, burst)
        self.assertEqual(round(one["calls_per_req"] * 10), 2)
        self.assertEqual(round(three["calls_per_req"] * 10), 6)
        self.assertGreater(three["max_util"], one["max_util"])
        # Without lanes every request is a call of its own in both.
        a = sim.parse(["--instances", "1", "--masters", "1", "--sublogs", "3", "--batch", "1"])
        self.assertEqual(sim.sim_single(a, burst)["calls_per_req"], 1.0)
        self.assertEqual(sim.sim_sublogs(a, burst)["calls_per_req"], 1.0)

    def test_real_run_shape(self):
        # The small real run (scripts/bench-hot-route, docs/design/hot-routes.md): three sub-logs
        # on three masters take a third of the calls each, and make about three times the calls
        # per request of one log at that run's rates.
        one, three = load().real_run()
        self.assertEqual(one["max_share"], 1.0)
        self.assertLessEqual(three["max_share"], 0.37)
        self.assertGreaterEqual(three["calls_per_req"] / one["calls_per_req"], 2.5)
        self.assertLessEqual(three["calls_per_req"] / one["calls_per_req"], 4.0)

    def test_home_sub_log_keeps_batches(self):
        # Starting each instance at a sub-log of its own keeps one lane per instance busy, so
        # its calls carry more requests than round-robin's at the same load.
        sim = load()
        args = ["--instances", "16", "--masters", "8", "--rate", "200000", "--duration", "0.1"]
        rr = sim.sim_sublogs(sim.parse(args))
        home = sim.sim_sublogs(sim.parse(args + ["--pick", "home"]))
        self.assertLess(home["calls_per_req"], 0.5 * rr["calls_per_req"])
        self.assertGreaterEqual(home["admitted"], 0.99 * home["arrived"])  # answers after the end excepted

    def test_deterministic(self):
        sim = load()
        a = sim.parse(["--rate", "5000", "--duration", "0.5", "--limit", "1000", "--window-ms", "100"])
        for fn in sim.DESIGNS.values():
            self.assertEqual(fn(a), fn(a))


if __name__ == "__main__":
    unittest.main()
