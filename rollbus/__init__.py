"""rollbus: event-sourced rollouts for coding-agent RL."""
