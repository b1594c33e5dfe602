"""Named model pairs, and the recipe that builds the bundled demo pair."""
