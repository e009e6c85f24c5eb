"""HAPI: near-data transfer learning over cloud object stores (the core both tiers share)."""
