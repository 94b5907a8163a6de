"""Framework integrations, imported on demand (importing partialcoll imports neither
framework): `import partialcoll.integrations.torch`, `from partialcoll.integrations import jax`."""
