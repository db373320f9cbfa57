"""``rollbus ui``: a read model of the topics behind server-rendered pages (overview, rollout, topics)."""
