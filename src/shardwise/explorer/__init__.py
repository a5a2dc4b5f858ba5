"""The explorer: a web page that shows FSDP's mechanism while a real sharded run trains.

Layout (imports flow downward):
    server.py    Starlette app: static page, SSE feed, POST controls (and replay routes)
    session.py   one run as the page sees it: config, seed, step, history; drives workers
    workers.py   RunConfig and WorkerGroup: 1-4 long-lived rank processes on loopback
    rank.py      what each rank process runs: shardwise on the MLP, events, memory
    problem.py   the data (4 classes on a plane in 16-D) and the 676-parameter MLP
    caution.py   interconnect numbers for the chosen config at real scale (planner)
    replay.py    a recorded `shardwise train` run read back from its event logs
    static/      index.html, style.css, js/*.js: plain ES modules, no build step
"""
