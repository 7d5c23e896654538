"""`make demo`: four trainers averaging an MLP on sklearn's digits through four local daemons."""
