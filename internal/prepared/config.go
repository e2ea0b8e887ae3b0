package prepared

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// Config is what a record is matched with in the CNI config on a
// command's stdin, read without encoding/json's reflection, which a
// process that serves one command pays for in full (see cnirelay).
type Config struct {
	// Canonical is the config without its prevResult: the same bytes for
	// every pod a runtime starts with one network config, which the
	// agent learns from the ADDs it serves and prepares records for.
	Canonical []byte
	// CNIVersion is the config's cniVersion; PrevCNIVersion its
	// prevResult's.
	CNIVersion, PrevCNIVersion string
	// RunDir is cni_agent_run_dir, "" when not set.
	RunDir string
	// PrevResult is the previous plugin's result as it came, nil when
	// there is none.
	PrevResult []byte
}

// errUnread: the config uses JSON this reader leaves to encoding/json
// (escapes in the keys or strings it reads); the caller then takes the
// slow path, which parses it whole.
var errUnread = errors.New("a config this reader leaves to the plugin")

// ParseConfig reads the top level of a CNI config. It checks the
// object's structure and that the prevResult is valid JSON; a config that
// matches a learnt canonical form is otherwise the one the agent parsed
// whole when it learnt it.
func ParseConfig(stdin []byte) (*Config, error) {
	c := &Config{Canonical: make([]byte, 0, len(stdin))}
	c.Canonical = append(c.Canonical, '{')
	seen := map[string]bool{}
	err := members(stdin, func(key string, value []byte) error {
		// encoding/json, which the plugin reads the config with, takes a
		// key's last value and matches keys without regard to case:
		// such configs are left to it.
		lower := strings.ToLower(key)
		if seen[lower] {
			return errUnread
		}
		seen[lower] = true
		for _, known := range []string{"prevResult", "cniVersion", "cni_agent_run_dir"} {
			if key != known && strings.EqualFold(key, known) {
				return errUnread
			}
		}
		switch key {
		case "prevResult":
			if !json.Valid(value) {
				return errors.New("prevResult is not valid JSON")
			}
			if bytes.Equal(value, []byte("null")) {
				return nil
			}
			c.PrevResult = value
			return members(value, func(k string, v []byte) error {
				if k == "cniVersion" {
					s, err := plainString(v)
					c.PrevCNIVersion = s
					return err
				}
				return nil
			})
		case "cniVersion", "cni_agent_run_dir":
			s, err := plainString(value)
			if err != nil {
				return err
			}
			if key == "cniVersion" {
				c.CNIVersion = s
			} else {
				c.RunDir = s
			}
		}
		if len(c.Canonical) > 1 {
			c.Canonical = append(c.Canonical, ',')
		}
		c.Canonical = appendQuoted(c.Canonical, key)
		c.Canonical = append(append(c.Canonical, ':'), value...)
		return nil
	})
	if err != nil {
		return nil, err
	}
	c.Canonical = append(c.Canonical, '}')
	return c, nil
}

func appendQuoted(b []byte, s string) []byte {
	return append(append(append(b, '"'), s...), '"')
}

// plainString is a JSON string value without escapes.
func plainString(v []byte) (string, error) {
	if len(v) < 2 || v[0] != '"' || v[len(v)-1] != '"' {
		return "", fmt.Errorf("%s is not a string", v)
	}
	s := v[1 : len(v)-1]
	if bytes.IndexByte(s, '\\') >= 0 {
		return "", errUnread
	}
	return string(s), nil
}

// members calls fn with each member of the JSON object b, its key
// unquoted and its value as it is written.
func members(b []byte, fn func(key string, value []byte) error) error {
	i := skipSpace(b, 0)
	if i == len(b) || b[i] != '{' {
		return errors.New("the config is not a JSON object")
	}
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return trailing(b, i+1)
	}
	for {
		if i == len(b) || b[i] != '"' {
			return errors.New("the config's object is malformed")
		}
		end, err := skipString(b, i)
		if err != nil {
			return err
		}
		key, err := plainString(b[i:end])
		if err != nil {
			return err
		}
		i = skipSpace(b, end)
		if i == len(b) || b[i] != ':' {
			return errors.New("the config's object is malformed")
		}
		i = skipSpace(b, i+1)
		end, err = skipValue(b, i)
		if err != nil {
			return err
		}
		if err := fn(key, b[i:end]); err != nil {
			return err
		}
		i = skipSpace(b, end)
		switch {
		case i < len(b) && b[i] == ',':
			i = skipSpace(b, i+1)
		case i < len(b) && b[i] == '}':
			return trailing(b, i+1)
		default:
			return errors.New("the config's object is malformed")
		}
	}
}

func trailing(b []byte, i int) error {
	if skipSpace(b, i) != len(b) {
		return errors.New("bytes after the config's object")
	}
	return nil
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipString returns the index after the string that starts at i.
func skipString(b []byte, i int) (int, error) {
	for j := i + 1; j < len(b); j++ {
		switch b[j] {
		case '\\':
			j++
		case '"':
			return j + 1, nil
		}
	}
	return 0, errors.New("a string in the config is not closed")
}

// skipValue returns the index after the value that starts at i; values
// other than strings, objects and arrays end at the next delimiter.
func skipValue(b []byte, i int) (int, error) {
	if i == len(b) {
		return 0, errors.New("the config ends where a value should be")
	}
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				end, err := skipString(b, j)
				if err != nil {
					return 0, err
				}
				j = end - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, errors.New("an object or array in the config is not closed")
	}
	j := i
	for j < len(b) && bytes.IndexByte([]byte(",}] \t\r\n"), b[j]) < 0 {
		j++
	}
	if j == i {
		return 0, errors.New("the config's object is malformed")
	}
	return j, nil
}
