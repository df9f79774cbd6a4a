"""One round on the agent's side: what to run next, sync, train, encode, check, upload,
delayed and eager rounds, the residency gate, and where the round's time goes."""
