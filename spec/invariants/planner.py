"""PL-*: invariants of the hybrid offload planner (snapshot subject ``"planner"``)."""
