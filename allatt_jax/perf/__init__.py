"""Measuring tools apart from the library: step timing, compiled-HLO counts and
profiles, compile and benchmark summaries."""
