"""How the processes of a ddp job are started, find each other, and end together.

``launcher.py`` joins a world somebody started (torchrun, SLURM) or starts one by re-running the
script (``world.py`` reads where this process sits from its environment); ``spawn.py`` starts the
ranks with multiprocessing spawn (``ddp_spawn``) and ``worker_state.py`` is what travels between the
caller and those workers; ``exits.py`` turns the ranks' exit statuses into words and into the job's
status; ``processes.py`` makes sure no process outlives the job (dying with the parent, stopping
children and their descendants) and that a forked child drops the group's connections;
``interrupt.py`` makes Ctrl-C one line for the job rather than a traceback per rank. Nothing here
knows a strategy: the ddp strategy holds a launcher and calls it.
"""
