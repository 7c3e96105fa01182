"""Prometheus metrics of the API (``GET /metrics``).

Two kinds:

- **counted in this process**: request latency (a histogram per method, route template and
  status class) and bundle downloads (by answer: ``200`` sent, ``304`` not modified);
- **read from the database at scrape time** (:class:`DatabaseCollector`): jobs by status,
  trials by state, kernels, and workers seen recently. Workers are other processes, often on
  other machines: counting in the database is the only view that is right for all of them,
  and a scrape every 15 s or so costs a few indexed ``count(*)`` queries.

Each app has its own :class:`CollectorRegistry`, so several apps in one process (tests) do
not collide.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session

from service.store.models import JOB_STATUSES, TRIAL_STATES, Job, KernelRecord, TrialRecord, WorkerRecord

log = logging.getLogger("foldwise.metrics")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class DatabaseCollector(Collector):
    """Gauges computed from the database when Prometheus scrapes."""

    def __init__(self, sessions: Callable[[], Session], *, alive_within_s: float):
        self.sessions = sessions
        self.alive_within_s = alive_within_s

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self._families())  # without samples: registration does not query the database

    @staticmethod
    def _families() -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("foldwise_jobs", "Jobs by status (from the database)", labels=["status"])
        yield GaugeMetricFamily("foldwise_trials", "Recorded trials by state (from the database)", labels=["state"])
        yield GaugeMetricFamily("foldwise_kernels", "Tuned kernels stored (from the database)")
        yield GaugeMetricFamily("foldwise_workers_alive",
                                "Workers whose last heartbeat is recent (from the database)")

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs, trials, kernels, workers = self._families()
        try:
            with self.sessions() as session:
                by_status = dict(session.execute(sa.select(Job.status, sa.func.count()).group_by(Job.status)).all())
                by_state = dict(session.execute(
                    sa.select(TrialRecord.state, sa.func.count()).group_by(TrialRecord.state)).all())
                n_kernels = session.scalar(sa.select(sa.func.count()).select_from(KernelRecord)  # finished, not partial
                                           .where(KernelRecord.partial == sa.false())) or 0
                since = datetime.now(UTC) - timedelta(seconds=self.alive_within_s)
                alive = session.scalar(sa.select(sa.func.count()).select_from(WorkerRecord)
                                       .where(WorkerRecord.last_heartbeat >= since)) or 0
        except sa.exc.SQLAlchemyError as err:  # a scrape must not fail because the database is busy
            log.warning("metrics: database gauges unavailable", extra={"error": str(err)[:300]})
            return
        for status in JOB_STATUSES:
            jobs.add_metric([status], by_status.get(status, 0))
        for state in TRIAL_STATES:
            trials.add_metric([state], by_state.get(state, 0))
        kernels.add_metric([], n_kernels)
        workers.add_metric([], alive)
        yield from (jobs, trials, kernels, workers)


class Metrics:
    """The registry of one app and the metrics counted in this process."""

    def __init__(self, sessions: Callable[[], Session] | None = None, *, alive_within_s: float = 60.0):
        self.registry = CollectorRegistry()
        self.requests = Histogram(
            "foldwise_http_request_duration_seconds", "HTTP request latency", ["method", "route", "status"],
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.bundle_downloads = Counter(
            "foldwise_bundle_downloads", "Bundle downloads by answer (200 sent, 304 not modified)", ["result"],
            registry=self.registry)
        if sessions is not None:
            self.registry.register(DatabaseCollector(sessions, alive_within_s=alive_within_s))

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, f"{status // 100}xx").observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) in the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
