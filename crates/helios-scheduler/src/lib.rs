//! helios-scheduler (filled by its issue).
