"""regional_agent package."""
