"""One job's rounds: the engine, the state machine of a round and the decision what to do
next, the protocol's answers about a delta, the deadline, quarantine, and the records."""
