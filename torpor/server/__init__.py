"""The torpor server: the one process that owns engine state (sandboxes, timers, names).

::

    app.py                 create_app(manager): lifespan (manager start/close, idle supervisor),
                           error mapping, the routers below
    routes_sandboxes.py    /v1/sandboxes: create, by-name get-or-create, get, list, pause,
                           resume, kill
    routes_exec.py         /v1/sandboxes/{id}/commands, /files, /interpreter (+ NDJSON streams)
    routes_checkpoints.py  snapshots, forks, volumes, drives, GC
    auth.py                bearer tokens -> tenants (the unix socket is the local tenant)
    deps.py                what every route depends on: the manager and the caller's tenant
    daemon.py              serve(): one server per home (pidfile lock), 0600 unix socket or TCP

Run it with ``torpor serve``; the SDK (:mod:`torpor.client`) starts it on demand.
"""
