"""Framework integrations (imported on demand: `import partialcoll.integrations.torch`)."""
