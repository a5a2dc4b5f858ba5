"""The communication layer: the only code that issues a torch.distributed collective.

process_group.py   a group's life (init, restart store, exit drain) and membership
work.py            a collective in flight (Work), the one door every collective goes through
transport.py       how a group moves flat buffers (native or all-to-all), chosen once per group
exchange.py        bytes / JSON / floats between ranks (never pickle)
collectives.py     the small tensor collectives, and the layer's one import name
distributed.py     init_distributed, no_sync
"""
