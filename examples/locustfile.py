"""Load-test the example web app with locust (how `dynamic-batcher` users load-test):

    pip install locust
    locust -f examples/locustfile.py --host http://127.0.0.1:8000 --users 100 --spawn-rate 20
"""

from __future__ import annotations

import random

from locust import HttpUser, between, task


class WebAppUser(HttpUser):
    wait_time = between(0.0, 0.1)

    @task
    def infer(self) -> None:
        values = [random.gauss(0, 1) for _ in range(16)]
        item = random.randint(1, 10_000)
        self.client.post(f"/items/batch/{item}", json={"values": values}, name="/items/batch/[id]")
