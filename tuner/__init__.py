"""`ferry tune`: find the batching setting with the most throughput within a latency SLO, by
measuring it under open-loop load against a running gateway.

By what each module does:

- `cli`: the command (`ferry tune`, `python -m tuner`): arguments, the grid, the run;
- `sweep`: every cell (setting x arrival rate): apply the setting, run locust, one results row;
- `scrape`: the gateway under tuning, through its admin API and /metrics;
- `recommend`: the pick and the evidence printed for it;
- `plot`: the figures;
- `locustfile`, `arrivals`: the load itself (locust's entry and events, open-loop arrival
  schedules), with `users` (the locust users), `options` (the locustfile's options) and
  `report` (its JSON report);
- `traffic`: the traffic classes and locust entry names both sides share;
- `percentile`: the one percentile definition (also used by the benchmarks in loadtests/).

Needs the `load` extra (locust, matplotlib). Nothing here is imported by the gateway
itself; `gateway/cli.py` only hands `ferry tune ...` to `tuner.cli.main`.
"""
