"""The agent↔worker contract, the one thing both processes of a region import.

:mod:`~regional_agent.handoff.messages` (what each file carries),
:mod:`~regional_agent.handoff.directory` (where the files live, how they are written),
:mod:`~regional_agent.handoff.settings` (the worker's command line and environment), and
what both sides compute alike: training statistics, utilization intervals, FLOPs, the
delayed round's arithmetic, the rounding of a delta, the residual file.
"""
