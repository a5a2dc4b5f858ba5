"""The communication layer: the only code that issues a torch.distributed collective.

process_group.py   a group's life (init_distributed, Slurm's variables, exit drain), subgroups
work.py            a collective in flight (Work), the one door every collective goes through
transport.py       how a group moves flat buffers (native or all-to-all), chosen once per group
collectives.py     the small tensor collectives, bytes / JSON between ranks, the one import name
"""
