"""Tests of measure."""
