"""What runs report beyond their metrics: the demo's report and table, figures,
compile and benchmark summaries, and the README's generated blocks."""
