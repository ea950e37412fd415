"""The behaviour contract checked from the outside, one file per section of it."""
