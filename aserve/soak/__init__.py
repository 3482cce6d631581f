"""``aserve soak``: a long replay with faults injected at random and in combination, and the
figures that say whether anything was lost or leaked (issue 27).

    trace (cycled) ──client thread (own loop, aiohttp)──► HTTP ──► ApiServer + Cluster (this loop)
        a third of the requests cut: a client disconnect,              ▲ FaultInjector: transfer
        or an abort, at a random point of their stream                 │ failures and stalls past
                                                                       │ the timeout, a kill and a
    Probe (this loop): RSS, free blocks per instance, loop lag         │ later re-add, flips; one
        (a series), open sockets, requests in flight                   │ or two at a time
                                 ▼
    report: completed / errored / lost, leaked blocks, RSS growth after warm-up, loop-lag p99 and
    max, recovery time per kill, counts per fault; one plot

- ``settings``: ``SoakConfig`` (frozen, checked);
- ``client``: the load and its cuts, one ``SoakRecord`` per request;
- ``faults``: the server-side faults and each kill's recovery;
- ``probe``: the samples;
- ``report``: the JSON report, its invariants and the plot;
- ``run``: one soak, start to end.
"""
