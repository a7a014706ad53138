"""The goodput planner that picks speculation lengths and tiers, its start-up profiles and its options."""
