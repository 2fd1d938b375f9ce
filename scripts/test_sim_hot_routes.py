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

    def test_deterministic(self):
        sim = load()
        a = sim.parse(["--rate", "5000", "--duration", "0.5", "--limit", "1000", "--window-ms", "100"])
        for fn in sim.DESIGNS.values():
            self.assertEqual(fn(a), fn(a))


if __name__ == "__main__":
    unittest.main()
