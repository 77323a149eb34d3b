"""Running jobs on a schedule: cron entries."""
