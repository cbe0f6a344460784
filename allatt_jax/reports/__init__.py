"""What runs report beyond their metrics: the demo's report and table, figures and
the README's generated blocks."""
