"""The rank process of a region's worker group (``python -m regional_agent.worker.rank``).

It imports only itself and :mod:`regional_agent.handoff`: the agent's side never runs here.
"""
