"""Where teacher outputs come from: the sources behind ``teacher.source`` (`kinds`), the config keys of both models
(`sources`), the offline cache (`cache`), the sub-mesh teacher (`mesh`), teacher checkpoints (`checkpoint`)."""
