"""The front's one /metrics page of every process (server/front.py `merge_metrics`), read back by Prometheus's own
parser: each family once, each series labelled with its process, values and labels as each process wrote them."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rtc_agent.loop_lag import watched_process
from rtc_agent.server.front import merge_metrics
from rtc_agent.server.metrics import Metrics


def test_every_process_series_keeps_its_labels_and_value_under_its_process() -> None:
    front = CollectorRegistry()
    watched_process(front)
    refused = Counter("rtc_agent_connections_refused", "closed at once", registry=front)
    refused.inc(3)
    media = []
    for n in range(2):
        metrics = Metrics()
        metrics.rejected.labels('odd "reason", with a space').inc(n + 1)
        metrics.engine_ms.labels("ttfp_ms").observe(12.5 * (n + 1))
        media.append(metrics)
    pages = [("front", generate_latest(front).decode()),
             *((f"m{n}", m.render().decode()) for n, m in enumerate(media))]
    merged = merge_metrics(pages)

    names = [family.name for family in text_string_to_metric_families(merged)]
    assert len(names) == len(set(names))  # one header per family
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(merged) for s in family.samples}
    expected = {}
    for process, text in pages:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not s.name.endswith("_created"):  # (start times of counters and histograms: left out)
                    expected[(s.name, tuple(sorted({**s.labels, "process": process}.items())))] = s.value
    assert got == expected
    assert got[("rtc_agent_connections_refused_total", (("process", "front"),))] == 3
    assert got[("rtc_agent_offers_rejected_total", (("process", "m1"), ("reason", 'odd "reason", with a space')))] == 2
    assert got[("rtc_agent_engine_step_ms_sum", (("metric", "ttfp_ms"), ("process", "m1")))] == 25.0
