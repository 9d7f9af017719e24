"""The ddp watchdog: a rank that keeps the others waiting is named, with its stack, and the job ends.

``watchdog.py`` holds the beacon the step path writes, the thread that samples it and the job's
store it publishes to; ``verdicts.py`` reads the ranks' records and words the verdicts;
``stacks.py`` prints a process's stacks, and exits with them. The ddp strategy owns one watchdog per
rank; nothing here imports a strategy.
"""
