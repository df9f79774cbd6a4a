"""From accepted deltas to the next global parameters: weighted and robust averaging,
the running sum of the open round, the outer optimizer, and one outer round."""
